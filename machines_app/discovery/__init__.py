"""Turn a listing of the ``*.gguf`` files in a machine's models directory into model entries.

Pure Python, no Django, no file system access of its own: the caller lists the
files and supplies a ``read_head(key, nbytes, offset=0)`` function (local read, SSH, ...)
or a batch ``read_ranges`` (:data:`machines_app.discovery.heads.ReadRanges`).
Only the head of each file (header + metadata, see :mod:`machines_app.gguf`) is
ever read, never the weights.

Rules:

* Split sets: files named ``<prefix>-NNNNN-of-MMMMM.gguf`` (llama.cpp's
  gguf-split naming, 5-digit numbers starting at 1) in the same directory with the
  same prefix and part count are one model, listed once under the key of part 1
  (llama-server is given the first part and finds the rest). Metadata comes from
  part 1, or from the lowest present part when part 1 is missing.
* Vision projectors: a file whose name starts with ``mmproj`` (any case), or whose
  ``general.architecture`` is ``clip``, is not a model; it sets ``has_vision`` on
  every model in the same directory, and ``projector_key`` to the projector's key (the
  first by key when a directory holds several): the file llama-server is given with
  ``--mmproj``.
* Names (:func:`model_name`): a model is shown by its GGUF identity, the way people say
  it. ``general.name`` first; where the name leaves out the ``general.size_label`` or
  the ``general.finetune`` ("Llama 3.1" of an "8B" "Instruct" file) they are added. A
  ``general.name`` that is only llama.cpp's converter title-casing the checkpoint
  directory it read (its words are exactly ``general.basename``, ``general.version``,
  ``general.size_label`` and ``general.finetune``: "Smollm2 135M 8k Lc100K Mix1 Ep2") names
  a training run, not the model: when the file name starts with that basename and says
  something else ("SmolLM2-135M-Instruct-Q8_0.gguf"), the file name wins, without its
  quantisation suffix. Without ``general.name``, the basename, size label and finetune;
  without those, the file name without ``.gguf`` (and without ``-00001-of-0000N`` for
  split sets). When two or more models share a name (compared ignoring case and
  surrounding spaces) each is shown as ``"<name> (<file name>)"``.
* A file that cannot be parsed, or whose ``general.architecture`` is missing, empty or
  not a string (llama-server cannot load it), is still listed, with ``error`` set and
  its file name as display name, so the admin sees it; such entries cannot be started.

The package, one job a module, each importing only those above it:

* :mod:`.keys` — model keys checked, split-set parts told by their names;
* :mod:`.heads` — a file's head read (header and metadata, never the weights);
* :mod:`.identity` — what a head says of its model: its name, its architecture;
* :mod:`.listing` — :func:`discover`: the listing grouped, read and named into :class:`ModelInfo`.
"""

from .heads import (
    BATCH_BYTES,
    INITIAL_HEAD_BYTES,
    MAX_HEAD_BYTES,
    ReadHead,
    ReadRanges,
    read_model_head,
    read_model_heads,
)
from .identity import architecture_problem, model_name
from .keys import InvalidModelKey, split_key_parts, validate_key
from .listing import ModelInfo, discover

__all__ = [
    "BATCH_BYTES",
    "INITIAL_HEAD_BYTES",
    "MAX_HEAD_BYTES",
    "InvalidModelKey",
    "ModelInfo",
    "ReadHead",
    "ReadRanges",
    "architecture_problem",
    "discover",
    "model_name",
    "read_model_head",
    "read_model_heads",
    "split_key_parts",
    "validate_key",
]
