"""Scheduler process entry: `python -m scheduler_proc.main --config PATH`."""

from __future__ import annotations

import signal
import sys

from ledgerserve.scheduler_proc.loop import SchedulerShell
from ledgerserve.shared.gc_tuning import settle_after_start
from ledgerserve.shared.proc import child_args, exit_with_parent, load_config, setup_logging


def main(argv: list[str] | None = None) -> int:
    args = child_args(argv)
    log = setup_logging("scheduler")
    config = load_config(args.config)
    shell = SchedulerShell(config)

    def launcher_gone(reason: str) -> bool:  # on the parent-watch thread: the loop closes the log and exits
        shell.request_stop(reason, dead_process="launcher")
        return True

    exit_with_parent(config.run_dir, launcher_gone)
    signal.signal(signal.SIGTERM, lambda *_: shell.request_stop("stopped by SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settle_after_start()
    try:
        return shell.run()
    except Exception:
        log.exception("scheduler failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
