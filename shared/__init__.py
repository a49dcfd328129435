"""Events, codec, sockets and config shared by every ledgerserve process."""
