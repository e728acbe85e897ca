"""The xpusense per-node agent: sources, the tier loop, and the stream to the collector."""
