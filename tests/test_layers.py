"""The package's layers, checked by walking its imports (``tests/import_graph.py``).

Dependencies point one way: ``core`` (pure) <- ``sim`` / ``runtime`` / ``api`` <- ``serve``
<- the CLI; the load client talks to a server only over HTTP; hypercorn and h11 are
touched only by ``serve/transport``, which the rest of the server reaches through its
interface (the package's ``__init__``). The order is checked twice: by layers (``LAYERS``:
every import points to a lower layer) and unit by unit (``MAY_IMPORT``: which packages
each package may import).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.import_graph import PACKAGE, cycles, graph, modules, reachable

GRAPH = graph()
PACKAGE_NAME = "inference_lab"
IO_OR_CLOCK = {"trio", "quart", "quart_trio", "hypercorn", "h11", "time", "random", "asyncio"}


def _top(name: str) -> str:
    return name.split(".")[0]


CORE = sorted(m for m in modules() if m.startswith("inference_lab.core"))


def test_the_core_folder_is_walked() -> None:
    """The purity test below covers the engine, the roofline and the config loader."""
    assert {
        "inference_lab.core.engine.engine",
        "inference_lab.core.engine.scheduler",
        "inference_lab.core.roofline",
        "inference_lab.core.config",
    } <= set(CORE)


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_io_or_clock(module: str) -> None:
    """Every module of ``core/``, and every package module it reaches, imports no trio,
    quart, hypercorn, h11, ``time``, global ``random`` or asyncio: time and randomness are
    arguments."""
    for mod in reachable(GRAPH, module):
        bad = {d for d in GRAPH[mod] if _top(d) in IO_OR_CLOCK}
        assert not bad, f"{mod} (reached from {module}) imports {sorted(bad)}"


def test_no_import_cycles() -> None:
    """No two package modules import each other, directly or around a circle (lazy
    imports inside functions and ``TYPE_CHECKING`` imports count)."""
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a circle made by hand is reported."""
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(fake) == [["a", "b", "c"]]


def test_only_the_transport_touches_hypercorn_and_h11() -> None:
    """hypercorn and h11 are imported only under ``serve/transport/``; the load client's
    own HTTP/1.1 client uses h11 as a client and is not the server's transport."""
    allowed = ("inference_lab.serve.transport", "inference_lab.client")
    for mod, deps in GRAPH.items():
        if mod.startswith(allowed):
            continue
        bad = sorted(d for d in deps if _top(d) == "h11" or d.startswith("hypercorn"))
        assert not bad, f"{mod} imports {bad}"


#: What the load client may import from the package outside ``client/``: the command-line
#: toolkit and the pure traffic shapes (sessions, traces) with what they import.
CLIENT_MAY_IMPORT = (
    "inference_lab.client",
    "inference_lab.cli_args",
    "inference_lab.traffic",
    "inference_lab.errors",
    "inference_lab.validation",
    "inference_lab.jsonbytes",
    "inference_lab.socket_stamps",
)

TRANSPORT = "inference_lab.serve.transport"


def _past_the_interface(graph_: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, transport module) for every import of one of the transport's modules
    from outside the transport."""
    return sorted(
        (mod, dep)
        for mod, deps in graph_.items()
        if not (mod == TRANSPORT or mod.startswith(TRANSPORT + "."))
        for dep in deps
        if dep.startswith(TRANSPORT + ".")
    )


def test_the_server_reaches_the_transport_only_through_its_interface() -> None:
    """Outside ``serve/transport/`` the package imports the transport's interface (the
    package ``inference_lab.serve.transport``), never one of its modules."""
    assert _past_the_interface(GRAPH) == []
    assert any(TRANSPORT in deps for deps in GRAPH.values())  # the interface is used


def test_the_interface_check_can_fail() -> None:
    """An import of a transport module from outside, made by hand, is reported; the
    transport's own imports of its modules are not."""
    fake = {
        "inference_lab.serve.streaming": {TRANSPORT + ".connection"},
        TRANSPORT: {TRANSPORT + ".connection", TRANSPORT + ".launch"},
    }
    assert _past_the_interface(fake) == [
        ("inference_lab.serve.streaming", TRANSPORT + ".connection")
    ]


def test_client_depends_only_on_the_http_api() -> None:
    """Nothing in ``client/`` reaches the server side of the package: the load client
    talks to a server only over HTTP. Outside ``client/`` it reaches only the
    command-line toolkit and the pure ``traffic`` package (session files, trace readers)
    with what that reaches: ``errors`` (and its ``jsonbytes``) and ``validation``."""
    for mod in GRAPH:
        if not mod.startswith("inference_lab.client"):
            continue
        for dep in reachable(GRAPH, mod):
            if dep.startswith("inference_lab"):
                assert dep.startswith(CLIENT_MAY_IMPORT), f"{mod} reaches {dep}"


#: What the prefill/decode proxy may reach: the load client's HTTP stack (with what it
#: may reach) and the server's transport interface (hypercorn's trio worker) with its own
#: modules, and the command-line toolkit.
PROXY_MAY_REACH = (
    *CLIENT_MAY_IMPORT,
    "inference_lab.proxy",
    "inference_lab.serve.transport",
)


def test_the_proxy_depends_only_on_the_http_api() -> None:
    """``inference-lab proxy`` talks to its backends over HTTP only: it reaches the load
    client's HTTP stack and the transport that serves it, never the serve app, the
    runtime or the engine."""
    own = [m for m in GRAPH if m.startswith("inference_lab.proxy")]
    assert len(own) >= 4
    for mod in own:
        for dep in reachable(GRAPH, mod):
            if dep.startswith("inference_lab"):
                assert dep.startswith(PROXY_MAY_REACH), f"{mod} reaches {dep}"


GENERATE = "inference_lab.generate"


def _module_random_calls(path: Path) -> list[str]:
    """``random.<name>`` uses other than the ``random.Random`` type in a module: calls on
    the global generator, where randomness should have been an argument."""
    return sorted(
        f"random.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "random"
        and node.attr != "Random"
    )


def test_generate_is_pure_and_below_the_wire_format() -> None:
    """``generate/`` (schema instances, regex strings, the placeholder words) imports
    nothing of the package outside itself, no I/O or clock, and draws only from the
    caller's ``random.Random``; ``api/`` imports it."""
    own = [m for m in modules() if m == GENERATE or m.startswith(GENERATE + ".")]
    assert len(own) >= 4
    for mod in own:
        package_deps = {d for d in GRAPH[mod] if _top(d) == "inference_lab"}
        outside = sorted(d for d in package_deps if not d.startswith(GENERATE))
        assert not outside, f"{mod} imports {outside}"
        bad = {d for d in GRAPH[mod] if _top(d) in IO_OR_CLOCK - {"random"}}
        assert not bad, f"{mod} imports {sorted(bad)}"
        assert _module_random_calls(modules()[mod]) == [], mod
    assert any(
        d.startswith(GENERATE + ".")
        for m, deps in GRAPH.items()
        if m.startswith("inference_lab.api")
        for d in deps
    )


def test_the_random_check_can_fail(tmp_path: Path) -> None:
    """A call on the global generator, written by hand, is reported; the type is not."""
    path = tmp_path / "m.py"
    path.write_text(
        "import random\ndef f(rng: random.Random) -> float:\n    return random.random()\n"
    )
    assert _module_random_calls(path) == ["random.random"]


def test_sim_never_reaches_the_serve_stack() -> None:
    """The offline simulator reaches neither the HTTP app nor the trio runtime."""
    for mod in modules():
        if mod.startswith("inference_lab.sim"):
            reached = reachable(GRAPH, mod)
            bad = sorted(
                m for m in reached if m.startswith(("inference_lab.serve", "inference_lab.runtime"))
            )
            assert not bad, f"{mod} reaches {bad}"


#: The layers of ``docs/internals.md``'s picture, lowest first: a package (or a top-level
#: module) imports only from lower layers; the shared modules of layer 0 import only each
#: other. ``client`` is further fenced (it may reach only the command-line toolkit and
#: ``traffic``: ``test_client_depends_only_on_the_http_api``).
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer)
    for layer in (
        {"errors", "jsonbytes", "validation", "resources", "socket_stamps", "cli_args"},
        {"traffic", "generate", "web", "executors"},
        {"core"},
        {"workload", "api", "runtime"},
        {"sim"},
        {"calibrate", "plan", "serve", "client"},
        {"proxy"},
        {"cli"},
        {"__main__"},
    )
)


def _unit(module: str) -> str:
    """The top-level package or module of ``inference_lab`` that ``module`` belongs to
    (``inference_lab`` itself for the package's ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_breaches(graph_: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) for every import that does not point to a lower layer (or, in
    layer 0, to another shared module); a unit in no layer is reported as ``(unit, "?")``."""
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    out: list[tuple[str, str]] = []
    own = {m: {d for d in deps if d.startswith(PACKAGE_NAME + ".")} for m, deps in graph_.items()}
    for mod, deps in sorted(own.items()):
        unit = _unit(mod)
        if unit == PACKAGE_NAME:
            continue
        if unit not in rank:
            out.append((unit, "?"))
            continue
        for dep in sorted(deps):
            other = _unit(dep)
            if other == unit or other not in rank:
                continue  # (within a package; a missing unit is reported as its own)
            if rank[other] < rank[unit] or rank[other] == rank[unit] == 0:
                continue
            out.append((mod, dep))
    return sorted(set(out))


def test_packages_import_only_from_lower_layers() -> None:
    """The order between packages that ``docs/internals.md`` states: traffic shapes,
    generated content, page parts and the executors below the core, then the workload
    generators, the wire format and the trio runtime, then the simulator, then the tools
    built on it and the server, then the command; every unit of the package is in a
    layer."""
    assert _layer_breaches(GRAPH) == []
    units = {_unit(m) for m in modules()} - {PACKAGE_NAME}
    assert units == set().union(*LAYERS)


def test_the_layer_check_can_fail() -> None:
    """An import upwards, one sideways within a layer and a unit in no layer, made by
    hand, are reported; imports downwards and within a package are not."""
    fake = {
        "inference_lab.core.engine": {"inference_lab.sim.run", "inference_lab.core.config"},
        "inference_lab.api.text": {"inference_lab.runtime.lag", "inference_lab.generate.x"},
        "inference_lab.extra.mod": {"inference_lab.core.engine"},
        "inference_lab.errors": {"inference_lab.jsonbytes"},
    }
    assert _layer_breaches(fake) == [
        ("extra", "?"),
        ("inference_lab.api.text", "inference_lab.runtime.lag"),
        ("inference_lab.core.engine", "inference_lab.sim.run"),
    ]


#: Which other units of the package each unit may import, beyond the shared modules of
#: layer 0 (which import only each other): ``docs/internals.md``'s picture (``X ──► Y``: Y
#: imports X) and the notes under it, as the code has them. Finer than ``LAYERS``: a unit
#: may not import every lower layer, only these (the load client: ``traffic`` alone).
#: ``cli`` loads each subcommand's module by name (``importlib``), which the walk does not
#: see.
MAY_IMPORT: dict[str, frozenset[str]] = {
    unit: frozenset(allowed)
    for unit, allowed in {
        **{shared: () for shared in LAYERS[0]},
        "traffic": (),
        "generate": (),
        "web": (),
        "executors": (),
        "core": ("traffic",),
        "workload": ("core", "traffic"),
        "api": ("core", "generate"),
        "runtime": ("core",),
        "sim": ("core", "workload", "traffic", "api", "web", "executors"),
        "calibrate": ("core", "sim"),
        "plan": ("core", "sim", "executors"),
        "serve": ("core", "api", "runtime", "generate", "web"),
        "client": ("traffic",),
        "proxy": ("client", "serve"),
        "cli": (),
        "__main__": ("cli",),
    }.items()
}


def _unit_imports(graph_: dict[str, set[str]]) -> dict[str, dict[str, str]]:
    """For each unit, the other non-shared units it imports, each with the first module
    (in name order) that does so."""
    out: dict[str, dict[str, str]] = {}
    for mod, deps in sorted(graph_.items()):
        unit = _unit(mod)
        for dep in sorted(deps):
            if not dep.startswith(PACKAGE_NAME + "."):
                continue
            other = _unit(dep)
            if other != unit and other not in LAYERS[0]:
                out.setdefault(unit, {}).setdefault(other, mod)
    return out


def _undeclared_imports(
    graph_: dict[str, set[str]], table: dict[str, frozenset[str]]
) -> list[tuple[str, str]]:
    """(module, unit) for every unit a module imports that ``table`` does not allow its
    own unit (a unit missing from the table is allowed nothing)."""
    return sorted(
        (mod, other)
        for unit, imported in _unit_imports(graph_).items()
        if unit != PACKAGE_NAME
        for other, mod in imported.items()
        if other not in table.get(unit, frozenset())
    )


def test_each_package_imports_only_the_packages_the_table_allows() -> None:
    """The order between packages, unit by unit: ``core`` only the traffic shapes; the
    workload generators, the wire format and the runtime the core (the wire format also
    ``generate``); the simulator what it runs; the server the wire format, the runtime
    and the core; the load client only the traffic shapes (it talks to a server over
    HTTP); every unit is in the table."""
    assert _undeclared_imports(GRAPH, MAY_IMPORT) == []
    units = {_unit(m) for m in modules()} - {PACKAGE_NAME}
    assert units == set(MAY_IMPORT)


def test_the_table_points_down_the_layers() -> None:
    """Every import the table allows goes to a lower layer: the table refines the layers,
    never contradicts them."""
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = sorted(
        (unit, other)
        for unit, allowed in MAY_IMPORT.items()
        for other in allowed
        if rank[other] >= rank[unit]
    )
    assert upward == []


def test_the_table_check_can_fail() -> None:
    """Imports the table does not allow, made by hand, are reported: the load client
    importing the core (downwards, so the layers allow it), the core importing the
    workload generators (upwards), a unit the table does not name; a shared module, an
    import within a package and an allowed one are not."""
    fake = {
        "inference_lab.client.load": {"inference_lab.core.roofline", "inference_lab.errors"},
        "inference_lab.core.engine": {"inference_lab.workload.arrivals", "inference_lab.core.x"},
        "inference_lab.sim.run": {"inference_lab.core.engine", "inference_lab.workload.arrivals"},
        "inference_lab.extra.mod": {"inference_lab.core.engine"},
    }
    assert _undeclared_imports(fake, MAY_IMPORT) == [
        ("inference_lab.client.load", "core"),
        ("inference_lab.core.engine", "workload"),
        ("inference_lab.extra.mod", "core"),
    ]


def test_the_package_is_where_the_walk_looks() -> None:
    """The walk reads the package's own files (a moved package would make every test
    above pass vacuously)."""
    assert (PACKAGE / "core" / "engine" / "engine.py").is_file()
    assert len(GRAPH) > 30
