"""Generated corpora of parallel records, the reader's lesson in "this is stated for something
else": offices, product editions, staff, sites and software settings, each record stating some
of its domain's attributes and not others, several attributes of one answer type side by side
(opened, moved, renovated: all years). A question asks one attribute of one record:

  stated   the record states it: gold = its value
  missing  the record does not state it, its siblings do (and the record states other
           attributes of the same type): gold = the null span
  absent   no record of that name exists, its siblings state the attribute: gold = null

A corpus is rendered in one style — prose, a Markdown or HTML table, Markdown lists, `key:
value` lines or an HTML definition list — and read through the product's own ingestion
(data/formats.py), so the reader learns the text it will meet: a table row as formats writes
it, a section under its heading path. Everything is drawn from a seeded generator: the same
(seed, index) gives the same corpus and question on every machine.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ralm.atomic import atomic_path
from ralm.data.formats import html_sections, markdown_sections
from ralm.errors import RalmError

# -- what records hold ------------------------------------------------------------------------

_SYLLABLES = ("al", "ba", "cor", "den", "el", "fa", "gil", "har", "is", "jor", "kel", "lan", "mir", "nor", "ol", "pen",
              "quin", "ros", "sal", "tav", "ur", "vel", "wyn", "yar", "zan", "bel", "cas", "dor", "ev", "fen")
_GIVEN = ("Amara", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Keiko", "Luca",
          "Maya", "Nikolai", "Olga", "Pavel", "Rosa", "Samir", "Talia", "Umar", "Vera", "Wen", "Yusuf", "Zofia", "Theo",
          "Priya", "Mateo", "Leila", "Oskar", "Nadia")
_FAMILY = ("Abbott", "Barros", "Castell", "Dumont", "Eriksen", "Fischer", "Garza", "Hollis", "Ibarra", "Jansen",
           "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quinlan", "Rossi", "Schmidt", "Tanaka",
           "Varga", "Whitfield", "Yilmaz", "Zeller", "Marsh", "Delacroix", "Brennan", "Sato", "Haddad", "Kovac")
_BRANDS = ("Nimbus", "Quarry", "Lattice", "Beacon", "Harbor", "Orbit", "Cobalt", "Fathom", "Juniper", "Vantage")
_TIERS = ("Starter", "Team", "Business", "Enterprise", "Basic", "Plus", "Pro", "Ultimate", "Edge", "Scale")
_ROLES = ("data engineer", "product manager", "accountant", "designer", "support lead", "recruiter", "lawyer",
          "site reliability engineer", "sales director", "research scientist")
_TEAMS = ("Payments", "Platform", "Growth", "Finance", "Legal", "Research", "Support", "Security", "Design", "Sales")
_SITE_KINDS = ("depot", "laboratory", "data centre", "warehouse", "workshop", "research station")
_COMPANIES = ("Ardent Logistics", "Borealis Power", "Cinder Works", "Dunmore Holdings", "Equinox Labs", "Foxglove Ltd")


def _place(rng: np.random.Generator) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(int(rng.integers(2, 4)))).capitalize()


def _person(rng: np.random.Generator) -> str:
    return f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"


def _count(lo: int, hi: int):
    return lambda rng: str(int(rng.integers(lo, hi)))


def _thousands(lo: int, hi: int):
    return lambda rng: f"{int(rng.integers(lo, hi)) * 1000:,}"


def _year(lo: int, hi: int):
    return lambda rng: str(int(rng.integers(lo, hi)))


@dataclass(frozen=True)
class Attribute:
    name: str
    type: str  # what its value is: year, count, person, ... (a domain holds several of one type)
    label: str  # a column header or list label
    draw: object  # rng -> value text
    statements: tuple[str, ...]  # prose, "{e}" the record's name, "{v}" the value
    questions: tuple[str, ...]  # "{e}" the record's name


def _a(name, type_, label, draw, statements, questions) -> Attribute:
    return Attribute(name, type_, label, draw, tuple(statements), tuple(questions))


@dataclass(frozen=True)
class Domain:
    name: str  # plural, the heading of its section
    kind: str  # how a question names a record: "{e}" in `refer`
    refer: str  # "the {e} office"
    draw_name: object  # rng -> a record's name
    attributes: tuple[Attribute, ...]


DOMAINS: tuple[Domain, ...] = (
    Domain("Offices", "office", "the {e} office", _place, (
        _a("headcount", "count", "Headcount", _count(8, 400), ["{v} people work in the {e} office.", "The {e} office employs {v} people."],
           ["How many people work in the {e} office?", "What is the headcount of the {e} office?",
            "How many employees does the {e} office have?"]),
        _a("desks", "count", "Desks", _count(10, 300), ["The {e} office has {v} desks.", "There are {v} desks in {e}."],
           ["How many desks does the {e} office have?", "What is the number of desks in the {e} office?"]),
        _a("rooms", "count", "Meeting rooms", _count(2, 30), ["{e} has {v} meeting rooms.", "The office offers {v} meeting rooms."],
           ["How many meeting rooms does the {e} office have?", "How many meeting rooms are there in {e}?"]),
        _a("parking", "count", "Parking spaces", _count(0, 120), ["The {e} office has {v} parking spaces.", "Staff in {e} share {v} parking spaces."],
           ["How many parking spaces does the {e} office have?", "How much parking is there at the {e} office?"]),
        _a("opened", "year", "Opened", _year(1960, 2024), ["The {e} office opened in {v}.", "It first opened in {v}."],
           ["When did the {e} office open?", "In what year was the {e} office opened?"]),
        _a("moved", "year", "Moved in", _year(1990, 2025), ["The {e} office moved to its current building in {v}.", "It moved into its present premises in {v}."],
           ["When did the {e} office move to its current building?", "In what year did the {e} office move?"]),
        _a("renovated", "year", "Renovated", _year(1995, 2025), ["The {e} office was renovated in {v}.", "A renovation of the office finished in {v}."],
           ["When was the {e} office renovated?", "In what year was the {e} office last renovated?"]),
        _a("lead", "person", "Office lead", _person, ["The {e} office is led by {v}.", "{v} is the office lead in {e}."],
           ["Who leads the {e} office?", "Who is the office lead in {e}?"]),
        _a("reception", "person", "Receptionist", _person, ["{v} runs the front desk in {e}.", "The receptionist in {e} is {v}."],
           ["Who is the receptionist of the {e} office?", "Who runs the front desk at the {e} office?"]),
    )),
    Domain("Editions", "edition", "the {e} edition", lambda rng: f"{rng.choice(_BRANDS)} {rng.choice(_TIERS)}", (
        _a("price", "money", "Price per month", lambda rng: f"${int(rng.integers(5, 400))}", ["The {e} edition costs {v} per month.", "{e} is priced at {v} a month."],
           ["How much does the {e} edition cost per month?", "What is the monthly price of the {e} edition?"]),
        _a("users", "count", "Maximum users", _count(3, 5000), ["The {e} edition supports up to {v} users.", "{e} allows {v} users at most."],
           ["How many users does the {e} edition support?", "What is the user limit of the {e} edition?"]),
        _a("connections", "count", "Client connections", _thousands(1, 90), ["{e} accepts {v} client connections.", "The {e} edition handles {v} concurrent client connections."],
           ["How many client connections does the {e} edition accept?", "What is the connection limit of the {e} edition?"]),
        _a("projects", "count", "Projects", _count(1, 800), ["The {e} edition includes {v} projects.", "With {e} you can create {v} projects."],
           ["How many projects does the {e} edition include?", "How many projects can be created with the {e} edition?"]),
        _a("storage", "size", "Storage", lambda rng: f"{int(rng.integers(1, 200)) * 5} GB", ["{e} comes with {v} of storage.", "The {e} edition includes {v} of storage."],
           ["How much storage does the {e} edition include?", "What is the storage of the {e} edition?"]),
        _a("released", "year", "Released", _year(2008, 2026), ["The {e} edition was released in {v}.", "{e} first shipped in {v}."],
           ["When was the {e} edition released?", "In what year did the {e} edition ship?"]),
        _a("retired", "year", "End of support", _year(2020, 2032), ["Support for {e} ends in {v}.", "The {e} edition reaches end of support in {v}."],
           ["When does support for the {e} edition end?", "In what year does the {e} edition reach end of support?"]),
        _a("retention", "duration", "Log retention", lambda rng: f"{int(rng.choice([7, 14, 30, 60, 90, 365]))} days", ["{e} keeps logs for {v}.", "Logs are retained for {v} in the {e} edition."],
           ["How long does the {e} edition keep logs?", "What is the log retention of the {e} edition?"]),
    )),
    Domain("Staff", "person", "{e}", _person, (
        _a("role", "role", "Role", lambda rng: str(rng.choice(_ROLES)), ["{e} works as a {v}.", "{e} is a {v}."],
           ["What is the role of {e}?", "What does {e} work as?"]),
        _a("team", "team", "Team", lambda rng: str(rng.choice(_TEAMS)), ["{e} belongs to the {v} team.", "{e} is on the {v} team."],
           ["Which team is {e} on?", "What team does {e} belong to?"]),
        _a("joined", "year", "Joined", _year(1995, 2026), ["{e} joined the company in {v}.", "{e} has been with the company since {v}."],
           ["When did {e} join the company?", "In what year did {e} start at the company?"]),
        _a("promoted", "year", "Last promoted", _year(2000, 2026), ["{e} was last promoted in {v}.", "{e} received a promotion in {v}."],
           ["When was {e} last promoted?", "In what year was {e} promoted?"]),
        _a("manager", "person", "Manager", _person, ["{e} reports to {v}.", "The manager of {e} is {v}."],
           ["Who does {e} report to?", "Who is the manager of {e}?"]),
        _a("mentor", "person", "Mentor", _person, ["{e} is mentored by {v}.", "The mentor of {e} is {v}."],
           ["Who mentors {e}?", "Who is the mentor of {e}?"]),
        _a("extension", "number", "Extension", _count(100, 9999), ["{e} can be reached on extension {v}.", "The phone extension of {e} is {v}."],
           ["What is the phone extension of {e}?", "On which extension can {e} be reached?"]),
        _a("city", "place", "Based in", _place, ["{e} is based in {v}.", "{e} works from {v}."],
           ["Where is {e} based?", "In which city does {e} work?"]),
    )),
    Domain("Sites", "site", "the {e}", lambda rng: f"{_place(rng)} {rng.choice(_SITE_KINDS)}", (
        _a("capacity", "count", "Capacity", _count(20, 5000), ["The {e} has a capacity of {v} pallets.", "{e} can hold {v} pallets."],
           ["What is the capacity of the {e}?", "How many pallets can the {e} hold?"]),
        _a("area", "size", "Floor area", lambda rng: f"{int(rng.integers(2, 400)) * 50} square metres", ["The {e} covers {v}.", "Its floor area is {v}."],
           ["How large is the {e}?", "What is the floor area of the {e}?"]),
        _a("staff", "count", "Staff", _count(3, 600), ["{v} people work at the {e}.", "The {e} has a staff of {v}."],
           ["How many people work at the {e}?", "How many staff does the {e} have?"]),
        _a("vehicles", "count", "Vehicles", _count(1, 90), ["The {e} runs {v} vehicles.", "A fleet of {v} vehicles is based at the {e}."],
           ["How many vehicles does the {e} run?", "How big is the vehicle fleet of the {e}?"]),
        _a("opened", "year", "Opened", _year(1950, 2025), ["The {e} opened in {v}.", "It began operating in {v}."],
           ["When did the {e} open?", "In what year did the {e} begin operating?"]),
        _a("expanded", "year", "Expanded", _year(1980, 2026), ["The {e} was expanded in {v}.", "An extension of the {e} was completed in {v}."],
           ["When was the {e} expanded?", "In what year was the {e} extended?"]),
        _a("operator", "company", "Operator", lambda rng: str(rng.choice(_COMPANIES)), ["The {e} is operated by {v}.", "{v} runs the {e}."],
           ["Who operates the {e}?", "Which company runs the {e}?"]),
        _a("manager", "person", "Site manager", _person, ["The site manager of the {e} is {v}.", "{v} manages the {e}."],
           ["Who manages the {e}?", "Who is the site manager of the {e}?"]),
    )),
    Domain("Settings", "setting", "the {e} setting",
           lambda rng: "_".join(str(w) for w in rng.choice(["max", "min", "default", "cache", "queue", "retry", "sync", "upload", "session", "batch", "worker", "index"], 2, replace=False)) + "_" + str(rng.choice(["size", "limit", "timeout", "count", "interval", "depth"])), (
        _a("default", "count", "Default", _count(1, 10000), ["The {e} setting defaults to {v}.", "By default {e} is {v}."],
           ["What is the default value of the {e} setting?", "What does {e} default to?"]),
        _a("minimum", "count", "Minimum", _count(0, 50), ["The smallest allowed value of {e} is {v}.", "{e} cannot be set below {v}."],
           ["What is the minimum value of {e}?", "What is the smallest value {e} accepts?"]),
        _a("maximum", "count", "Maximum", _thousands(1, 100), ["{e} accepts values up to {v}.", "The largest allowed value of {e} is {v}."],
           ["What is the maximum value of {e}?", "What is the largest value {e} accepts?"]),
        _a("introduced", "version", "Introduced in", lambda rng: f"{int(rng.integers(1, 9))}.{int(rng.integers(0, 20))}", ["{e} was introduced in version {v}.", "The {e} setting first appeared in release {v}."],
           ["In which version was {e} introduced?", "When was the {e} setting added?"]),
        _a("deprecated", "version", "Deprecated in", lambda rng: f"{int(rng.integers(9, 15))}.{int(rng.integers(0, 20))}", ["{e} was deprecated in version {v}.", "The {e} setting is deprecated since release {v}."],
           ["In which version was {e} deprecated?", "Since when is the {e} setting deprecated?"]),
        _a("variable", "name", "Environment variable", lambda rng: "APP_" + "".join(rng.choice(list("ABCDEFGHKLMNPRSTUVWXYZ"), 6)),
           ["{e} can also be set with the environment variable {v}.", "The environment variable {v} overrides {e}."],
           ["Which environment variable sets {e}?", "What environment variable overrides the {e} setting?"]),
        _a("owner", "person", "Owner", _person, ["The {e} setting is maintained by {v}.", "{v} owns the {e} setting."],
           ["Who maintains the {e} setting?", "Who owns the {e} setting?"]),
    )),
)
STYLES = ("prose", "markdown_table", "html_table", "markdown_list", "key_value", "html_definitions")
KINDS = ("stated", "missing", "absent")


@dataclass(frozen=True)
class Record:
    name: str
    values: dict  # attribute name -> value text, the attributes it states
    phrasing: dict  # attribute name -> which of its statements prose uses


@dataclass(frozen=True)
class SiblingCorpus:
    domain: Domain
    records: tuple[Record, ...]
    style: str
    title: str  # the document's title, e.g. "Handbook of Cobalt Works"

    def files(self) -> dict[str, str]:
        """{file name: contents}: the corpus as a user keeps it (one Markdown or HTML file)."""
        return render(self)

    def sections(self) -> list[tuple[str, str, str]]:
        """(id, title, text) of every section, read through the product's ingestion."""
        out = []
        for name, content in self.files().items():
            read = markdown_sections if name.endswith(".md") else html_sections
            out += [(name + s.anchor, s.title, s.text) for s in read(content.encode("utf-8"), name)]
        return out


@dataclass(frozen=True)
class SiblingQuestion:
    question: str
    answers: tuple[str, ...]  # () for a question the corpus cannot answer
    kind: str  # one of KINDS
    record: str  # the record asked about
    attribute: str


def make_corpus(rng: np.random.Generator, *, records: int | None = None, style: str | None = None) -> SiblingCorpus:
    """A corpus of `records` (default 3-8) parallel records of one random domain, each stating
    between half and all but one of the domain's attributes, rendered in `style` (default random)."""
    domain = DOMAINS[int(rng.integers(len(DOMAINS)))]
    n = int(records if records is not None else rng.integers(3, 9))
    names: dict[str, None] = {}
    for _ in range(50 * n):
        if len(names) >= n:
            break
        names[domain.draw_name(rng)] = None
    attrs = domain.attributes
    out = []
    for name in names:
        k = int(rng.integers(max(2, len(attrs) // 2), len(attrs)))  # never every attribute: one is missing
        picked = sorted(rng.choice(len(attrs), size=k, replace=False).tolist())
        out.append(Record(name, {attrs[i].name: attrs[i].draw(rng) for i in picked},
                          {attrs[i].name: int(rng.integers(len(attrs[i].statements))) for i in picked}))
    style = style or str(rng.choice(STYLES))
    if style not in STYLES:
        raise RalmError(f"unknown sibling style {style!r}; one of {', '.join(STYLES)}")
    owner = f"{rng.choice(_BRANDS)} {rng.choice(['Group', 'Works', 'Systems', 'Partners', 'Cooperative'])}"
    return SiblingCorpus(domain, tuple(out), style, f"{owner} {rng.choice(['handbook', 'directory', 'reference', 'wiki'])}")


def ask(corpus: SiblingCorpus, rng: np.random.Generator, kind: str | None = None) -> SiblingQuestion:
    """A question about the corpus of `kind` (default: stated half the time, missing 35%,
    absent 15%); a corpus where no record lacks an attribute its siblings state falls back to
    another kind."""
    kind = kind or str(rng.choice(KINDS, p=[0.5, 0.35, 0.15]))
    by_name = {a.name: a for a in corpus.domain.attributes}
    records = list(corpus.records)
    if kind == "missing":
        options = [(r, a) for r in records for a in by_name
                   if a not in r.values and any(a in o.values for o in records if o is not r)]
        # mostly the hard case: the record states another attribute of the asked one's type
        hard = [(r, a) for r, a in options if any(by_name[b].type == by_name[a].type for b in r.values)]
        if hard and rng.random() < 0.7:
            options = hard
        if not options:
            kind = "stated"
        else:
            record, attr = options[int(rng.integers(len(options)))]
            return _question(corpus, by_name[attr], record.name, (), "missing", rng)
    if kind == "absent":
        stated = [a for a in by_name if any(a in r.values for r in records)]
        taken = {r.name for r in records}
        for _ in range(50):
            name = corpus.domain.draw_name(rng)
            if name not in taken and all(name.lower() not in t.lower() for t in taken):
                return _question(corpus, by_name[stated[int(rng.integers(len(stated)))]], name, (), "absent", rng)
        kind = "stated"
    record = records[int(rng.integers(len(records)))]
    attr = sorted(record.values)[int(rng.integers(len(record.values)))]
    return _question(corpus, by_name[attr], record.name, (record.values[attr],), "stated", rng)


def _question(corpus, attr: Attribute, name: str, answers: tuple[str, ...], kind: str, rng) -> SiblingQuestion:
    template = attr.questions[int(rng.integers(len(attr.questions)))]
    return SiblingQuestion(template.format(e=name), answers, kind, name, attr.name)


# -- rendering ----------------------------------------------------------------------------------

def render(corpus: SiblingCorpus) -> dict[str, str]:
    """The corpus in its style as one file: {name: text}."""
    d, style = corpus.domain, corpus.style
    attrs = [a for a in d.attributes if any(a.name in r.values for r in corpus.records)]
    stem = "-".join(corpus.title.lower().split())
    if style in ("html_table", "html_definitions"):
        body = [f"<h1>{html.escape(corpus.title)}</h1>", f"<h2>{d.name}</h2>"]
        if style == "html_table":
            head = "".join(f"<th>{html.escape(a.label)}</th>" for a in attrs)
            rows = ["<tr><td>" + html.escape(r.name) + "</td>" + "".join(f"<td>{html.escape(r.values.get(a.name, ''))}</td>" for a in attrs)
                    + "</tr>" for r in corpus.records]
            body.append(f"<table><thead><tr><th>{d.kind.capitalize()}</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
        else:
            for r in corpus.records:
                items = "".join(f"<dt>{html.escape(a.label)}</dt><dd>{html.escape(r.values[a.name])}</dd>"
                                for a in d.attributes if a.name in r.values)
                body.append(f"<h3>{html.escape(r.name)}</h3><dl>{items}</dl>")
        page = (f"<!doctype html><html><head><title>{html.escape(corpus.title)}</title></head><body><main>"
                + "".join(body) + "</main></body></html>")
        return {f"{stem}.html": page}
    lines = [f"# {corpus.title}", "", f"## {d.name}", ""]
    if style == "markdown_table":
        lines.append("| " + " | ".join([d.kind.capitalize(), *(a.label for a in attrs)]) + " |")
        lines.append("|" + "---|" * (len(attrs) + 1))
        lines += ["| " + " | ".join([r.name, *(r.values.get(a.name, "") for a in attrs)]) + " |" for r in corpus.records]
    else:
        for r in corpus.records:
            lines += [f"### {r.name}", ""]
            stated = [a for a in d.attributes if a.name in r.values]
            if style == "prose":
                lines.append(" ".join(a.statements[r.phrasing[a.name]].format(e=r.name, v=r.values[a.name])
                                      for a in stated))
            elif style == "markdown_list":
                lines += [f"- {a.label}: {r.values[a.name]}" for a in stated]
            else:  # key_value: one `Label: value` line each (a hard break keeps the lines apart)
                lines += [f"{a.label}: {r.values[a.name]}  " for a in stated]
            lines.append("")
    return {f"{stem}.md": "\n".join(lines) + "\n"}


# -- training examples and corpora on disk -----------------------------------------------------

def training_example(seed: int, index: int, *, max_sections: int = 4) -> tuple[SiblingQuestion, list[tuple[str, str]]]:
    """Example `index` of seed `seed`: a question and the (title, text) sections read for it —
    the asked record's own section first where it has one, then siblings' — at most `max_sections`."""
    rng = np.random.default_rng([seed, index, 7])
    corpus = make_corpus(rng)
    q = ask(corpus, rng)
    sections = corpus.sections()
    own = [s for s in sections if s[1].endswith(q.record)]
    others = [s for s in sections if s not in own]
    picked = [others[i] for i in rng.permutation(len(others))[: max(max_sections - len(own), 0)].tolist()]
    return q, [(title, text) for _, title, text in (own + picked)[:max_sections]]


def write_sibling_corpus(out: str | os.PathLike, *, corpora: int, questions_per_corpus: int = 6, seed: int = 0) -> dict:
    """A folder `out` of `corpora` generated corpora (their files, as a user keeps them, under
    out/docs/) and out/questions.jsonl: `questions_per_corpus` questions of each, with "kind"
    (stated, missing, absent), "unanswerable" and "title" (the corpus a question belongs to: a
    group for fitting maps that leave whole corpora out). Written atomically."""
    rng = np.random.default_rng([seed, 11])
    rows, files = [], {}
    for c in range(corpora):
        corpus = make_corpus(rng)
        for name, text in corpus.files().items():
            files[f"c{c:04d}-{name}"] = text
        for j in range(questions_per_corpus):
            q = ask(corpus, rng)
            rows.append({"id": f"sib-{c:04d}-{j}", "question": q.question, "answers": list(q.answers) or ["unanswerable"],
                         "unanswerable": not q.answers, "kind": q.kind, "title": f"corpus {c:04d}"})
    out = Path(out)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "docs").mkdir()
        for name, text in files.items():
            (tmp / "docs" / name).write_text(text, encoding="utf-8")
        (tmp / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"corpora": corpora, "files": len(files), "questions": len(rows),
            "unanswerable": sum(r["unanswerable"] for r in rows)}

