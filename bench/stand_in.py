"""A machine whose llama-server is the fixed-rate stand-in (bench/rate_server.py), for the
benches that measure what Corral itself carries (bench/many_sessions.py,
bench/many_watchers.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _setup import ROOT


def stand_in_machine(data: Path):
    """A ``Machine`` named "stand-in" whose models directory holds one model file,
    ``stand-in.gguf`` (a GGUF head the catalogue reads; the stand-in never loads it), and
    whose llama-server is the stand-in (a script in a directory of its own). Returns ``(machine, model key)``."""
    import gguf

    from machines_app import catalog
    from machines_app.models import Machine

    models = data / "models"
    models.mkdir(exist_ok=True)
    model = models / "stand-in.gguf"
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_name("stand-in")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # Outside the data directory: a server's sandbox hides that (docs/security.md).
    script = Path(tempfile.mkdtemp(prefix="corral-stand-in-")) / "rate-llama-server"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'bench' / 'rate_server.py'} \"$@\"\n")
    script.chmod(0o755)
    machine = Machine.objects.create(name="stand-in", models_dir=str(models), llama_server_path=str(script))
    catalog.refresh_models(machine)
    return machine, model.name
