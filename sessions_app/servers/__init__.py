"""A session's llama-server, in one place (docs/architecture.md "A session's server"):
its rows (:mod:`.models`), its start (:mod:`.start`, :mod:`.adopt`, :mod:`.ready`), its
stop (:mod:`.stop`), its saved slots (:mod:`.slots`), its logs (:mod:`.logs`), its
sandbox (:mod:`.containment`) and the watch over it (:mod:`.watch`). It wires
:mod:`machines_app.llama_server` (no Django) to the database and the transcript.
"""
