"""The project's modules import one way only: no circle, and no import up the layers of
docs/architecture.md.

Every import of a project module counts — at module level, inside a function, or under
``TYPE_CHECKING`` — because a function-local import that closes a circle hides the circle
without removing it. A cycle fails the test with its path.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

PACKAGES = ("project", "machines_app", "sessions_app", "attention_app", "search_app", "usage_app", "api_app",
            "accounts_app")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[module_name(path)] = path
    return found


def imports_of(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The project modules that module ``name`` (whose text is ``source``) imports, anywhere."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the submodule when there is one.
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_function_local_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    assert imports_of("pkg.a", "def f():\n    from . import b\n", known) == {"pkg", "pkg.b"}
    assert imports_of("pkg.sub.c", "from ..b import x\nimport pkg.sub\n", known) == {"pkg.b", "pkg.sub"}
    assert imports_of("pkg.a", "if TYPE_CHECKING:\n    from pkg.sub.c import Y\n", known) == {"pkg.sub.c"}


def test_no_import_circle_among_the_projects_modules():
    modules = project_modules()
    graph = {
        name: imports_of(name, path.read_text(), set(modules), is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


# The layers of docs/architecture.md, lowest first. A module imports only modules of its
# own layer or of a layer below it. Every project module is in exactly one layer (a new
# module must be placed here, deliberately): the first layer whose pattern it matches.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Pure cores: no Django, no Celery, no Channels; only other pure cores.
    ("pure", (
        "project.broker", "project.channel_layer", "project.heap",
        "project.log_filters", "project.queues",
        "machines_app", "machines_app.gguf", "machines_app.memory",
        "machines_app.discovery", "machines_app.discovery.keys", "machines_app.discovery.heads",
        "machines_app.discovery.identity", "machines_app.discovery.listing",
        "machines_app.sandbox", "machines_app.demo_models",
        "machines_app.ssh", "machines_app.ssh.keys", "machines_app.ssh.sftp", "machines_app.ssh.connection",
        "machines_app.ssh.links", "machines_app.ssh.forwards",
        "sessions_app", "sessions_app.servers", "sessions_app.callcard", "sessions_app.allowances",
        "sessions_app.control_tokens", "sessions_app.rules", "sessions_app.tex",
        # The transcript's vocabulary and folds: a package of pure modules.
        "sessions_app.transcript", "sessions_app.transcript.vocabulary", "sessions_app.transcript.payloads",
        "sessions_app.transcript.reading", "sessions_app.transcript.messages", "sessions_app.transcript.folds",
        "sessions_app.transcript.versions",
        # What a tool is (plain data) and the plain reason it could not be reached.
        "sessions_app.tools.catalogue", "sessions_app.tools.failures",
        "sessions_app.live", "sessions_app.live.markdown",
        "sessions_app.export", "sessions_app.tool_results",
        # A completion's stream read as data: SSE lines, chunks, deltas, tool calls, errors.
        "sessions_app.completions.deltas", "sessions_app.completions.errors", "sessions_app.completions.sse",
        "sessions_app.completions.chunks", "sessions_app.completions.tool_calls",
        "sessions_app.agent.fragments",
        "attention_app", "attention_app.make_icons", "search_app", "usage_app", "api_app", "accounts_app",
    )),
    # Settings and process wiring read from the environment.
    ("config", (
        # The package itself loads the Celery app (Celery's pattern for Django projects).
        "project", "project.env", "project.data_dir", "project.settings", "project.celery", "project.launcher",
        "project.embedded_redis", "project.processes", "project.output_log",
        "project.websocket_security", "project.login_throttle", "project.pubsub_layer", "project.daphne_server",
    )),
    # Rows and what reaches a machine: models, transports, the llama-server client, reads
    # and renderers of stored events; pushes and task hand-offs by name.
    ("models", (
        "*.models", "machines_app.keystore", "machines_app.access",
        "machines_app.transports", "machines_app.transports.base", "machines_app.transports.commands",
        "machines_app.transports.local", "machines_app.transports.remote", "machines_app.transports.places",
        "machines_app.transports.relay",
        "machines_app.transports.tool_view", "machines_app.llama_server",
        "machines_app.workspaces", "machines_app.template_files", "machines_app.catalog",
        "sessions_app.completions", "sessions_app.completions.client", "sessions_app.completions.pacing",
        "sessions_app.tools", "sessions_app.tools.builtin", "sessions_app.tools.machine", "sessions_app.tools.mcp",
        "sessions_app.tools.use",
        "sessions_app.server_state", "sessions_app.dispatch", "sessions_app.liveness", "sessions_app.db_link",
        "sessions_app.images", "sessions_app.text_files", "sessions_app.templatetags*", "usage_app.quota", "usage_app.figures",
        # The live page (sessions_app/live/): its pushes, who is watching, its database
        # thread, its socket's Redis watch, and the renderers of stored events.
        "sessions_app.live.broadcast", "sessions_app.live.presence", "sessions_app.live.presence_board",
        "sessions_app.live.db_thread", "sessions_app.live.live_link", "sessions_app.live.sentences",
        "sessions_app.live.header", "sessions_app.live.items", "sessions_app.live.transcript_view",
        "accounts_app.backends",
    )),
    # Writes: each change with its event and its push (Zulip's do_*).
    ("actions", (
        "*.actions", "sessions_app.events", "sessions_app.turns", "sessions_app.room", "sessions_app.orphans",
        "sessions_app.access_changes", "sessions_app.importing", "sessions_app.machine_use",
        "sessions_app.first_run", "attention_app.waiting", "attention_app.push", "search_app.search",
        "usage_app.recording", "sessions_app.metering", "api_app.keys", "accounts_app.sso",
    )),
    # The work run by Celery: a session's server (sessions_app.servers, its rows above with the
    # models, its admin and the machines page below with the interface), the turn loop
    # (sessions_app.agent), and the tasks themselves. api_app.serving: the API's server for a
    # model file, started and kept like a session's.
    ("work", (
        "sessions_app.servers.records", "sessions_app.servers.logs", "sessions_app.servers.containment",
        "sessions_app.servers.slots", "sessions_app.servers.stop", "sessions_app.servers.ready",
        "sessions_app.servers.adopt", "sessions_app.servers.start", "sessions_app.servers.watch",
        "sessions_app.agent", "sessions_app.agent.step", "sessions_app.agent.lease",
        "sessions_app.agent.request", "sessions_app.agent.completion", "sessions_app.agent.calls",
        "sessions_app.agent.folds", "sessions_app.signals", "*.tasks", "api_app.serving",
        # The periodic rounds, run by threads of the housekeeping workers.
        "sessions_app.rounds",
    )),
    # What a person or a process reaches: views, forms, admin, sockets, URLs, commands.
    ("interface", (
        "*.views", "*.forms", "*.admin", "*.consumers", "*.urls", "*.routing", "*.apps",
        "*.context_processors", "*.management*", "project.asgi", "project.middleware", "project.metrics",
    )),
]
LAYER_NAMES = [name for name, _patterns in LAYERS]


def layer_of(module: str) -> str | None:
    """The first layer with a pattern matching ``module`` (``fnmatch``), or None."""
    from fnmatch import fnmatchcase

    for name, patterns in LAYERS:
        if any(fnmatchcase(module, pattern) for pattern in patterns):
            return name
    return None


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {
        name: imports_of(name, path.read_text(), set(modules), is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in project_modules() if layer_of(name) is None)
    assert not unplaced, f"place these modules in a layer of tests/test_layers.py: {unplaced}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module in a higher layer, as ``"a (layer) → b (layer)"``."""
    found = []
    for name, targets in sorted(graph.items()):
        rank = LAYER_NAMES.index(layer_of(name))
        for target in sorted(targets):
            if LAYER_NAMES.index(layer_of(target)) > rank:
                found.append(f"{name} ({layer_of(name)}) → {target} ({layer_of(target)})")
    return found


def test_the_layer_checker_finds_an_import_going_up():
    assert upward_imports({"sessions_app.transcript": {"sessions_app.models"}}) == [
        "sessions_app.transcript (pure) → sessions_app.models (models)"
    ]
    assert upward_imports({"sessions_app.views": {"sessions_app.models"}}) == []


def test_each_layer_imports_only_its_own_layer_or_those_below():
    graph = import_graph()
    assert [name for name in graph if layer_of(name) is None] == []
    assert upward_imports(graph) == []


def machines_app_imports_of_sessions_app(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a sessions_app module by a machines_app module, as ``"a → b"``."""
    def of(package: str, name: str) -> bool:
        return name == package or name.startswith(f"{package}.")

    return sorted(f"{name} → {target}" for name, targets in graph.items() if of("machines_app", name)
                  for target in targets if of("sessions_app", target))


def test_machines_app_imports_nothing_of_sessions_app():
    """machines_app (machines, model files, transports, the llama-server client) is what
    sessions are built on; sessions_app builds on it and never the other way: a session's
    server, its rows and its admin live in sessions_app.servers, and the machine admin's
    view of the servers is sessions_app's extension of machines_app's."""
    assert machines_app_imports_of_sessions_app({"machines_app.admin": {"sessions_app.servers.stop"}}) == [
        "machines_app.admin → sessions_app.servers.stop"
    ]
    assert machines_app_imports_of_sessions_app(import_graph()) == []


#: What a pure core never imports: the web and task frameworks (a client library such as
#: redis-py parsing a URL is fine).
FRAMEWORKS = ("django", "celery", "channels", "daphne", "kombu")


def test_the_pure_cores_import_no_django():
    """Anywhere in the module, function-local and TYPE_CHECKING imports included."""
    offending = []
    for name, path in sorted(project_modules().items()):
        if layer_of(name) != "pure":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            offending += [f"{name} imports {root}" for root in roots if root in FRAMEWORKS]
    assert offending == []


#: Functions still longer than LONGEST_FUNCTION, to be cut into named phases. The list only
#: shrinks: a function that gets short must leave it (the test says so).
LONG_FUNCTIONS_LEFT: set[str] = set()
LONGEST_FUNCTION = 80  # lines, decorators and docstring included


def long_functions() -> dict[str, int]:
    """``"module:Class.function"`` → its length in lines, for every function of the project
    (outside tests and bench) longer than LONGEST_FUNCTION."""
    found: dict[str, int] = {}

    def walk(module: str, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualified = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                if child.end_lineno - first + 1 > LONGEST_FUNCTION:
                    found[f"{module}:{qualified}"] = child.end_lineno - first + 1
                walk(module, child, f"{qualified}.")
            elif isinstance(child, ast.ClassDef):
                walk(module, child, f"{prefix}{child.name}.")

    for name, path in project_modules().items():
        walk(name, ast.parse(path.read_text()), "")
    return found


def test_no_function_is_longer_than_80_lines():
    found = long_functions()
    assert sorted(set(found) - LONG_FUNCTIONS_LEFT) == [], "cut these into named phases"
    assert sorted(LONG_FUNCTIONS_LEFT - set(found)) == [], "short now: take them out of LONG_FUNCTIONS_LEFT"
