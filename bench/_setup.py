"""What every bench script does first: a throwaway data directory, an embedded Redis unless
REDIS_URL is set, and Django set up on them (as ``./corral run`` would)."""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def boot(prefix: str) -> Path:
    """Prepare and return the bench's own data directory (``CORRAL_DATA_DIR``)."""
    sys.path.insert(0, str(ROOT))
    data = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("CORRAL_DATA_DIR", str(data))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

    from project.launcher import ensure_redis, prepare_data_dir

    prepare_data_dir()
    redis = ensure_redis()
    if redis is not None:
        atexit.register(redis.terminate)

    import django

    django.setup()
    return data
