"""`python -m xpusense.collector.cluster serve|worker|scheduler --nats URLS` (as `xpusense-collector`)."""

import sys

from .cli import main

sys.exit(main())
