# common/_compact.c: compact.decode_columns' reader in C.
from typing import Any

def decode(data: bytes | bytearray | memoryview, max_samples: int, last_ref_deltas: bytes | None,
           /) -> tuple[Any, ...] | None: ...
