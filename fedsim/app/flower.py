"""Flower app components for ``flwr run .`` (see ``[tool.flwr.app.components]`` in pyproject.toml).

``fedsim run`` is the primary entry point; this module lets Flower users start the same ServerApp and
ClientApp with Flower's own tooling (commands in ``docs/flwr-run.md``). The run config keys
(``[tool.flwr.app.config]``, override with ``flwr run . --run-config 'key="value" ...'``):

* ``config``: path of a fedsim TOML config (default ``experiments/default.toml``),
* ``overrides``: ``;``-separated ``section.key=value`` overrides,
* ``out``: run folder (default: a new folder under ``output.dir``).

Flower runs the ServerApp in a process of its own whose working directory is whatever directory the
local SuperLink was first started from, so relative paths in ``config``, ``out`` and ``output.dir``
are resolved against the fedsim project root (the checkout holding the installed ``fedsim``
package), not against the working directory. ``config`` falls back to the copy inside the app
bundle (FAB) when the project root has no such file. Absolute paths are used as they are.
"""
from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsim.app.client import client_app as _client_app

# The ClientApp component. A plain assignment (not only an import) because `flwr run` checks that
# the attribute named in `[tool.flwr.app.components]` is assigned in this module's source.
client_app = _client_app

server_app = ServerApp()


def project_root() -> Path:
    """The checkout that holds the imported ``fedsim`` package, or the working directory."""
    import fedsim

    root = Path(fedsim.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def resolve_config_path(path: str, root: Path, app_dir: Path | None = None) -> Path:
    """``path`` as is when absolute (load_config reports it if missing), else under ``root``, else under
    ``app_dir`` (the FAB copy). A relative path found in neither is a ConfigError naming both places."""
    from fedsim.config import ConfigError

    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    bases = [b for b in (root, app_dir) if b is not None]
    for base in bases:
        if (base / p).is_file():
            return base / p
    raise ConfigError(f"run config 'config' = {path!r}: no such file under "
                      + " or ".join(f"{str(b)!r}" for b in bases)
                      + " (the project root" + (", then the app bundle)" if app_dir is not None else ")"))


def _app_dir() -> Path | None:
    """The unpacked FAB (Flower puts it first on ``sys.path`` before loading the app)."""
    import sys

    for entry in sys.path:
        p = Path(entry) if entry else None
        if p is not None and p.parent.name == "apps" and (p / "pyproject.toml").is_file():
            return p  # $FLWR_HOME/apps/<publisher>.<name>.<version>.<hash>
    return None


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    from fedsim.app import validate
    from fedsim.app.runner import quiet_logs
    from fedsim.app.server import run_server
    from fedsim.config import dump_toml, read_config
    from fedsim.reports import atomic_write_text, new_run_dir

    quiet_logs()
    root = project_root()
    rc = context.run_config
    overrides = [s.strip() for s in str(rc.get("overrides", "")).split(";") if s.strip()]
    config_path = resolve_config_path(str(rc.get("config") or "experiments/default.toml"), root, _app_dir())
    # `flwr run`: this ServerApp runs in Flower's own process, not in the one that read the config, so it
    # loads and builds the components here, once (validation builds them; the server is handed those)
    cfg = read_config(str(config_path), overrides)
    components = validate(cfg)
    if rc.get("out"):
        out = Path(str(rc["out"])).expanduser()
        out = out if out.is_absolute() else root / out
    else:
        parent = Path(str(cfg["output"]["dir"])).expanduser()
        out = new_run_dir(parent if parent.is_absolute() else root / parent, cfg["name"])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.toml", dump_toml(cfg))
    print(f"[fedsim] run folder: {out}", flush=True)
    run_server(grid, cfg, out, components=components)
