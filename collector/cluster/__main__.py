"""`python -m xpusense.collector.cluster serve|worker|scheduler --nats URLS` (as `xpusense-collector`),
on the grpc engine `xpusense-collector` runs on (collector/main.py, common/grpc_engine.py): chosen
here, before .cli imports grpc."""

import sys

from xpusense.common.grpc_engine import POLLING_LISTENER, choose_engine

choose_engine(POLLING_LISTENER)

from .cli import main  # noqa: E402

sys.exit(main())
