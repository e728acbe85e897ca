"""The loader process's entry (launch.LOADER_BOOT): loadproc.main, compiling ahead when told the config.

`xpusense-agent run` starts its loader process before its own imports (launch.start_early) and names
its config file. The loader then works out, from that file's [sources.ebpf] table and this host, the
request the agent will send (family.expected_request: the same planning code the agent runs) and
compiles it while the agent is still starting. The agent's request, when it comes, decides: when it
asks for exactly what was compiled, the compiled objects are used; otherwise they are dropped and the
request is compiled as asked (loadproc.Ahead.take).
"""

from __future__ import annotations


def guess_request(config_path: str) -> dict | None:
    """The request an agent with `config_path` ("": the built-in defaults) will send on this host."""
    import tomllib

    from xpusense.common.config import load

    from .family import SCHEMA, expected_request
    keys: dict = {}
    if config_path:
        with open(config_path, "rb") as f:
            keys = tomllib.load(f).get("sources", {}).get("ebpf", {})
    table = load({"sources": {"ebpf": SCHEMA}}, None, env={}, flags={"sources.ebpf": keys} if keys else None)
    return expected_request(table.sources.ebpf)


def serve(fd: int, config_path: str | None) -> None:
    """The loader process: serve one request on socket `fd` (loadproc.main), compiling ahead from the
    agent's config when `config_path` is given. Does not return (the process ends with os._exit)."""
    from .loadproc import main
    main(fd, None if config_path is None else lambda: guess_request(config_path))
