"""`xpusense-collector`'s entry point: grpc's engine is chosen (common/grpc_engine.py) before
anything imports grpc, then the command line (cli.py) runs."""

from __future__ import annotations

import sys

from xpusense.common.grpc_engine import POLLING_LISTENER, choose_engine


def main(argv: list[str] | None = None) -> int:
    choose_engine(POLLING_LISTENER)
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
