"""The xpusense collector: ingest stream, fleet state, query API, exporters, scheduler core."""
