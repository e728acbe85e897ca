"""Code that runs inside the training jobs xpusense watches (standard library only)."""
