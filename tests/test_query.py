"""The query side's one config (retrieval/search/query.py): every field of QueryConfig is an option
of each query command, generated from the field, and the config the command builds reaches the
searcher and the reader whole. Adding a query option is one field: nothing threads it by hand."""

import dataclasses
import json

import pytest
import typer
from typer.testing import CliRunner

from ralm.cli import app
from ralm.commands.from_config import config_command, config_options
from ralm.configs import ConfigError, option
from ralm.retrieval.search.fusion import Fusion
from ralm.retrieval.search.query import QueryConfig

# the query commands, and the QueryConfig fields each leaves out (its config's `omit`: search and
# eval retrieval read nothing, eval retrieval's cut-offs are --ks, a server's requests give k and side)
COMMANDS = {("search",): {"min_confidence"}, ("ask",): set(), ("eval", "qa"): set(), ("demo",): set(),
            ("eval", "retrieval"): {"k", "min_confidence"}, ("serve",): {"k", "side"}}


def _command(path):
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.get_command(typer.Context(cmd), name)
    return cmd


def _flags(option) -> set[str]:
    return set(option.decls) | set(option.old)


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_query_field_is_an_option_generated_from_it(path):
    """Each QueryConfig field on the command line is its command's option with the field's flags
    (old spellings hidden), from the command's config; none is declared by the command itself."""
    cmd = _command(path)
    generated = {o.name: o for o in config_options(cmd.callback.config) if o.parent is not None}
    query = {o.name: o for o in config_options(QueryConfig)}
    assert set(generated) == set(query) - COMMANDS[path], path
    params = {p.name: p for p in cmd.params}
    for name, o in query.items():
        spelled = {flag for p in cmd.params for flag in p.opts if flag in _flags(o)}
        if name in COMMANDS[path]:
            assert not spelled, f"{' '.join(path)} takes {spelled} though its config omits {name}"
            continue
        assert set(params[name].opts) == set(o.decls) and spelled == _flags(o), (path, name, spelled)
        assert params[name].default == getattr(_default_query(cmd.callback.config), name)


def _default_query(config):
    field = next(f for f in dataclasses.fields(config) if f.type in (QueryConfig, "QueryConfig"))
    return field.default_factory()


class Stop(Exception):
    """Raised where the command hands its config on: what it passed is kept, nothing loads."""


@pytest.fixture
def handed(monkeypatch):
    """What each query command hands the library: OpenQA.open's, LiveSearcher.open's and the
    Service's arguments."""
    import ralm.cli
    import ralm.pipeline
    import ralm.retrieval.search.live
    import ralm.serve.service

    got = {}

    def keep(name):
        def call(*args, **kwargs):
            got[name] = (args, kwargs)
            raise Stop
        return call

    monkeypatch.setattr(ralm.pipeline.OpenQA, "open", keep("OpenQA.open"))
    monkeypatch.setattr(ralm.retrieval.search.live.LiveSearcher, "open", keep("LiveSearcher.open"))
    monkeypatch.setattr(ralm.serve.service, "Service", keep("Service"))
    monkeypatch.setattr(ralm.cli, "listen", lambda host, port: None)
    return got


def test_the_config_a_command_builds_reaches_the_library_whole(handed, tiny_hybrid_index, tmp_path):
    """Non-default values of every field, given on the command line (the old --retriever too),
    arrive as one QueryConfig: `query=`, never as k=, side= or min_confidence= threaded by hand."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q", "question": "Who?", "answers": ["x"]}) + "\n")
    index = str(tiny_hybrid_index)
    runs = {
        ("search", "paris", "--index", index, "-k", "3", "--side", "bm25"): ("LiveSearcher.open", QueryConfig(k=3, side="bm25")),
        ("ask", "who?", "--index", index, "--k", "4", "--retriever", "dense", "--min-confidence", "0.2"):
            ("OpenQA.open", QueryConfig(k=4, side="dense", min_confidence=0.2)),
        ("eval", "qa", "--index", index, "--questions", str(questions), "-k", "2", "--side", "bm25", "--min-confidence", "0"):
            ("OpenQA.open", QueryConfig(k=2, side="bm25", min_confidence=0.0)),
        ("eval", "retrieval", "--index", index, "--questions", str(questions), "--side", "dense"):
            ("LiveSearcher.open", QueryConfig(side="dense")),
        ("serve", "--index", index, "--min-confidence", "0.3"): ("Service", QueryConfig(min_confidence=0.3)),
    }
    for argv, (where, want) in runs.items():
        handed.clear()
        result = CliRunner().invoke(app, list(argv))
        assert isinstance(result.exception, Stop), (argv, result.output)
        args, kwargs = handed[where]
        got = args[0].query if where == "Service" else kwargs["query"]
        assert got == want, argv
        assert not {"k", "side", "min_confidence", "retriever"} & set(kwargs), (argv, kwargs)


def test_a_new_query_field_is_an_option_of_every_query_command_and_reaches_the_config():
    """Adding a query option is one field: a QueryConfig with one more field is, with no other
    edit, an option of a command whose config nests it, and its value is in the config built."""
    Deeper = dataclasses.make_dataclass("Deeper", [("depth", int, option(100, "candidates per side"))], bases=(QueryConfig,),
                                        frozen=True)

    @dataclasses.dataclass(frozen=True)
    class AskLike:
        query: Deeper = option(default_factory=Deeper)

    seen = {}

    @config_command
    def ask_like(*, cfg: AskLike):
        seen["query"] = cfg.query

    toy = typer.Typer()
    toy.command()(ask_like)
    result = CliRunner().invoke(toy, ["--depth", "7", "-k", "3", "--retriever", "bm25"])
    assert result.exit_code == 0, result.output
    assert seen["query"] == Deeper(k=3, side="bm25", depth=7)


def test_a_query_config_refuses_what_no_query_takes_naming_the_field():
    with pytest.raises(ConfigError, match=r"^k must be a positive integer, got 0$"):
        QueryConfig(k=0)
    with pytest.raises(ConfigError, match=r"^min_confidence must be in \[0, 1\], got 1.5$"):
        QueryConfig(min_confidence=1.5)
    assert QueryConfig(k=3).given(k=None, side="dense") == QueryConfig(k=3, side="dense")
    assert QueryConfig().fusion == Fusion()


def test_a_searchers_query_config_is_what_it_searches_with(tiny_hybrid_index):
    """Opened with a config, a searcher searches as it says (k, side, fusion) when a call names
    none; a call's own k and side win; `fusion`, its older attribute, reads and sets the config's."""
    from ralm.retrieval.search.searcher import Searcher

    plain = Searcher.open(tiny_hybrid_index)
    query = QueryConfig(k=2, side="bm25", fusion=Fusion("rrf"))
    searcher = Searcher.open(tiny_hybrid_index, query=query)
    assert searcher.query is query and searcher.fusion == Fusion("rrf")
    [hits] = searcher.search(["capital of France"])
    assert [h.id for h in hits] == [h.id for h in plain.search(["capital of France"], 2, "bm25")[0]]
    assert len(plain.search(["capital of France"])[0]) == 5  # SEARCH_K, as before
    fused = Searcher.open(tiny_hybrid_index, query=QueryConfig(fusion=Fusion("rrf")))
    assert ([h.score for h in fused.search(["capital of France"], 3)[0]]
            == [h.score for h in plain.search(["capital of France"], 3, query=QueryConfig(fusion=Fusion("rrf")))[0]])
    plain.fusion = Fusion("rrf")
    assert plain.query.fusion == Fusion("rrf")
