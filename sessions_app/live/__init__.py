"""The live session page, server side: everything between a stored transcript event and
what an open page shows (docs/live-page.md; module map in docs/architecture.md).

- ``consumers``: the page's websocket (catch-up by ``seq``, who may watch, close codes);
- ``broadcast``: every push to pages, after the transaction commits;
- ``presence``, ``presence_board``: who is watching, and one read per change per process;
- ``live_link``: a page is told when Redis, and so every push, is lost;
- ``db_thread``: the sockets' trips to the database, on one kept connection;
- ``transcript_view``: the one fold from events to the first paint and live operations;
- ``items``, ``sentences``, ``header``: what each event, setting, usage and the header show;
- ``markdown``: a reply's Markdown, sanitised (a pure core: no Django).

Nothing is imported here, so a pure module may import ``sessions_app.live.markdown``
without the rest.
"""
