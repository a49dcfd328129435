"""Pieces the scripts share: fixtures, report files, a server process, the request loop, plots."""
