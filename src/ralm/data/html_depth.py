"""How deep an HTML parser will nest a page's elements, found from its tags before it is parsed.

lexbor (resiliparse's parser) and resiliparse's main-content extraction spend time in the
depth of the tree for every element: 100,000 nested <div>s (1.1 MB) cost minutes, and lexbor
reopens misnested formatting tags (`<p><b id=1></p><p><b id=2></p>…`) into a tree as deep as
the page is long. `bounded_markup` takes the formatting tags but <a> out (they carry nothing the
text needs) and refuses a page whose tree would nest deeper than a browser's (Chromium stops at
512); `check_tree_depth` checks the parsed tree too, where a table's misplaced content is moved
(foster parenting). Parsing then costs time linear in the page.

The walk follows the HTML tree builder's rules (WHATWG §13.2.6, and lexbor where it differs)
for what opens and closes elements, simplified where the simplification closes fewer elements
than the parser does, so the depth it finds errs high (a page's content is never refused but
for hundreds of misnestings), low only by the <tbody>/<tr> a bare <td> implies, which it adds.
One pass, each tag O(1) amortised: per-name and per-kind position stacks answer "is there a <p>
in button scope" without walking the stack.
"""

from __future__ import annotations

import re

from ralm.errors import RalmError

MAX_DEPTH = 512  # Chromium's limit (kMaximumHTMLParserDOMTreeDepth); real pages nest under 100

_HEADINGS = frozenset(("h1", "h2", "h3", "h4", "h5", "h6"))
_VOID = frozenset("area base basefont bgsound br col embed frame hr image img input keygen link meta param source "
                  "track wbr".split())
_RAW = frozenset("script style textarea title xmp iframe noembed noframes".split())  # their text holds no tags
_FORMATTING = frozenset(("a",))  # the one formatting element left in a page (_INLINE_TAG takes out the rest)
# Formatting tags but <a> (whose link density main-content extraction weighs) say nothing a reader of the text
# needs, and lexbor reopens them past the standard's limit of three alike: taken out before parsing.
_INLINE_TAG = re.compile(r"</?(?:b|big|code|em|font|i|nobr|s|small|strike|strong|tt|u)(?=[\s/>])[^>]*>?", re.IGNORECASE)
_MARKERS = frozenset("applet object marquee template td th caption".split())  # formatting is not reopened across these
_SPECIAL = frozenset((
    "address applet area article aside base basefont bgsound blockquote body br button caption center col "
    "colgroup dd details dir div dl dt embed fieldset figcaption figure footer form frame frameset head header "
    "hgroup hr html iframe img input keygen li link listing main marquee menu meta nav noembed noframes noscript "
    "object ol p param plaintext pre script search section select source style summary table tbody td template "
    "textarea tfoot th thead title tr track ul wbr xmp foreignobject desc mi mo mn ms mtext annotation-xml").split()) | _HEADINGS
_SCOPE = frozenset("applet caption html table td th marquee object template foreignobject desc title mi mo mn ms "
                   "mtext annotation-xml select".split())  # <select>: lexbor closes nothing below one from inside it
# Kinds of element that stop a search down the stack for an element "in scope".
_KINDS = {  # named with an "@", apart from the elements' names
    "@special": _SPECIAL,
    "@scope": _SCOPE,
    "@button": _SCOPE | {"button"},
    "@list": _SCOPE | {"ol", "ul"},
    "@table": frozenset(("html", "table", "template", "select")),
    "@item": _SPECIAL - {"address", "div", "p"},  # what a new <li>, <dd>, <dt> does not close past
}
_TABLE_PARTS = frozenset("caption col colgroup tbody td tfoot th thead tr".split())  # ignored outside a table
_KINDS_OF = {name: tuple(k for k, names in _KINDS.items() if name in names) for name in set().union(*_KINDS.values())}
_CLOSES_P = frozenset("address article aside blockquote center details dialog dir div dl fieldset figcaption figure "
                      "footer header hgroup main menu nav ol p search section summary ul pre listing form plaintext "
                      "xmp table hr li dd dt".split()) | _HEADINGS
_END_SCOPE = {"p": "@button", "li": "@list", **{t: "@table" for t in "table tbody thead tfoot tr td th caption colgroup".split()},
              **{t: "@scope" for t in (_CLOSES_P - {"p", "li", "form", "plaintext", "table", "hr", "xmp"}) | _MARKERS - {"td", "th", "caption"}}}
_NO_REOPEN = (_CLOSES_P - {"xmp"}) | _TABLE_PARTS | frozenset(  # start tags that reopen no formatting
    "html head body frameset base basefont bgsound link meta noframes script style template title textarea iframe "
    "noembed rb rtc rp rt".split())
_FOREIGN_ROOTS = frozenset(("svg", "math"))
_INTEGRATION = {"svg": frozenset(("foreignobject", "desc", "title")),  # HTML again inside these
                "math": frozenset("mi mo mn ms mtext annotation-xml".split())}
_BREAKOUT = frozenset("b big blockquote body br center code dd div dl dt em embed h1 h2 h3 h4 h5 h6 head hr i img li "
                      "listing menu meta nobr ol p pre ruby s small span strong strike sub sup table tt u ul var".split())
_TOKEN = re.compile(r"<(?:!--|(/?)([a-z][^\s/>]*))")
_COMMENT_END = re.compile(r"--!?>")


class _Element:
    __slots__ = ("entry", "name", "space")

    def __init__(self, name: str, space: str, entry: _Entry | None = None):
        self.name, self.space, self.entry = name, space, entry  # space: "" (HTML), "svg" or "math"


class _Entry:
    """A formatting element in the list of active ones: reopened (a new element, one level
    deeper) wherever text follows after something closed it."""
    __slots__ = ("gone", "name", "open")

    def __init__(self, name: str):
        self.name, self.open, self.gone = name, None, False  # open: its element's position in the stack


class _Frame:
    """The active formatting elements since the last marker, and by name (gone ones are
    dropped from a list's end when it is read: each once)."""
    __slots__ = ("by_name", "entries")

    def __init__(self):
        self.entries: list[_Entry] = []
        self.by_name: dict[str, list[_Entry]] = {}

    def add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        self.by_name.setdefault(entry.name, []).append(entry)

    def find(self, name: str) -> _Entry | None:
        named = self.by_name.get(name)
        while named and named[-1].gone:
            named.pop()
        return named[-1] if named else None


class _Builder:
    """The parser's stack of open elements and list of active formatting elements, as its
    tags open and close them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.stack: list[_Element] = []
        self.at: dict[str, list[int]] = {}  # element name or kind -> its positions in the stack, bottom up
        self.frames: list[_Frame] = [_Frame()]  # a new one at each marker
        self.deepest = 0

    def last(self, name: str) -> int:
        positions = self.at.get(name)
        return positions[-1] if positions else -1

    def push(self, name: str, space: str = "", entry: _Entry | None = None) -> None:
        index = len(self.stack)
        self.stack.append(_Element(name, space, entry))
        for key in self.keys(self.stack[-1]):
            self.at.setdefault(key, []).append(index)
        if entry is not None:
            entry.open = index
        if name in _MARKERS:
            self.frames.append(_Frame())
        self.deepest = max(self.deepest, len(self.stack))
        if self.deepest > self.limit:
            raise _TooDeep

    @staticmethod
    def keys(element: _Element) -> tuple[str, ...]:
        """Where the element's position is kept: its name, its kinds, "@html" for an HTML one."""
        return (element.name, *_KINDS_OF.get(element.name, ()), *(() if element.space else ("@html",)))

    def pop_to(self, index: int) -> None:
        """Close the element at `index` and everything above it."""
        while len(self.stack) > index:
            element = self.stack.pop()
            for key in self.keys(element):
                self.at[key].pop()
            if element.entry is not None:
                element.entry.open = None
            if element.name in _MARKERS and len(self.frames) > 1:
                self.frames.pop()

    def in_scope(self, name: str, kind: str) -> int:
        """The position of the topmost `name` when no `kind` element stands above it, else -1."""
        index = self.last(name)
        return index if index >= 0 and index >= self.last(kind) else -1

    def in_foreign(self) -> bool:
        top = self.stack[-1] if self.stack else None
        return top is not None and top.space != "" and top.name not in _INTEGRATION[top.space]

    def reopen(self) -> None:
        """Reconstruct the active formatting elements: those closed since they opened, reopened."""
        frame = self.frames[-1].entries
        i = len(frame)
        while i and (frame[i - 1].gone or frame[i - 1].open is None):
            i -= 1
        reopened = [e for e in frame[i:] if not e.gone]
        frame[i:] = reopened  # entries taken off the list leave it here, each once
        for entry in reopened:
            self.push(entry.name, entry=entry)

    def entry(self, name: str) -> _Entry | None:
        return self.frames[-1].find(name)

    def end_formatting(self, name: str, *, restart: bool = False) -> bool:
        """The adoption agency algorithm's effect on the stack, bounded above: an open element
        with no special one above it is closed; with one (a misnesting the parser mends by
        moving elements, never deepening the stack) nothing is. `restart`: a new <a> in an open
        one, which leaves the list. False when `name` is not active."""
        entry = self.entry(name)
        if entry is None:
            return False
        if entry.open is None or self.last("@special") < entry.open:
            entry.gone = True
            if entry.open is not None:
                self.pop_to(entry.open)
        elif restart:
            entry.gone = True
        return True

    def start(self, name: str, self_closing: bool) -> None:
        if self.in_foreign():
            if name not in _BREAKOUT:
                if not self_closing:
                    self.push(name, self.stack[-1].space if name not in _FOREIGN_ROOTS else name)
                return
            while self.in_foreign():  # an HTML element ends the SVG or MathML it stands in
                self.pop_to(len(self.stack) - 1)
        if name == "select" and (index := self.in_scope("select", "@scope")) >= 0:
            self.pop_to(index)  # a <select> in one ends it
            return
        if name in ("html", "head", "body", "frameset") or (name in _TABLE_PARTS and max(self.last("table"), self.last("template")) < 0):
            return  # merged into the one the page has; a cell without a table is dropped
        if name in _CLOSES_P and (p := self.in_scope("p", "@button")) >= 0:
            self.pop_to(p)
        if name in ("li", "dd", "dt"):
            for item in (("li",) if name == "li" else ("dd", "dt")):
                if (index := self.in_scope(item, "@item")) >= 0:
                    self.pop_to(index)
        elif name in _HEADINGS and self.stack and self.stack[-1].name in _HEADINGS:
            self.pop_to(len(self.stack) - 1)
        elif name in ("option", "optgroup"):
            while self.stack and self.stack[-1].name in (("option",) if name == "option" else ("option", "optgroup")):
                self.pop_to(len(self.stack) - 1)
        elif name in ("td", "th", "tr", "tbody", "thead", "tfoot"):
            closes = {"td": ("td", "th"), "th": ("td", "th"), "tr": ("td", "th", "tr")}.get(name, ("td", "th", "tr", "tbody", "thead", "tfoot"))
            found = [i for i in (self.in_scope(t, "@table") for t in closes) if i >= 0]
            if found:
                self.pop_to(min(found))  # a new row closes the row, its open cell with it
            # the <tbody> and <tr> the parser implies (what it foster-parents out of the table stays: errs high)
            if name in ("td", "th", "tr") and max(self.in_scope(t, "@table") for t in ("tbody", "thead", "tfoot", "tr")) < 0:
                self.push("tbody")
            if name in ("td", "th") and self.in_scope("tr", "@table") < 0:
                self.push("tr")
        if name == "a":
            self.end_formatting("a", restart=True)  # a new <a> ends the open one
        if name not in _NO_REOPEN:
            self.reopen()
        if name in _VOID:
            return
        if name in _FORMATTING:
            entry = _Entry(name)
            self.frames[-1].add(entry)
            self.push(name, entry=entry)
        elif name not in _FOREIGN_ROOTS:
            self.push(name)
        elif not self_closing:
            self.push(name, name)

    def end(self, name: str) -> None:
        if self.stack and self.stack[-1].space and self.last(name) > self.last("@html"):
            self.pop_to(self.last(name))  # an SVG or MathML element, closed with those above it
            return
        if name in ("br", "p"):
            while self.in_foreign():  # these end the SVG or MathML they stand in, as their start tags do
                self.pop_to(len(self.stack) - 1)
        if name == "br":
            self.reopen()  # read as <br>
            return
        if name in ("html", "body", "form"):  # </form> takes the form out of the middle: kept (errs high)
            return
        if name in _FORMATTING and self.end_formatting(name):
            return
        if name in _HEADINGS:
            index = max(self.in_scope(h, "@scope") for h in _HEADINGS)
        elif name in _END_SCOPE:
            index = self.in_scope(name, _END_SCOPE[name])
        else:  # any other end tag: the topmost of its name, unless a special element stands above it
            index = self.in_scope(name, "@special")
        if index >= 0:
            self.pop_to(index)


class _TooDeep(Exception):
    pass


def _self_closing(attrs: str) -> bool:
    """Whether a tag ends in "/>" (what closes an SVG or MathML element): not where the "/"
    ends an unquoted attribute value (`<g id=2/>`)."""
    if not attrs.endswith("/"):
        return False
    last = attrs[:-1].split()[-1] if attrs[:-1].strip() and not attrs[-2].isspace() else ""
    return not last or last[-1] in "\"'" or "=" not in last


def bounded_markup(markup: str, name: str, *, limit: int = MAX_DEPTH) -> str:
    """`markup` as it is given to the parser, its formatting tags but <a> taken out; RalmError
    (naming the file `name`) when its tree would nest elements deeper than `limit`."""
    markup = _INLINE_TAG.sub("", markup)
    try:
        nesting_depth(markup, limit=limit)
    except _TooDeep:
        raise RalmError(f"{name}: the HTML nests elements deeper than {limit} levels (as no page does); "
                        "refusing to parse it") from None
    return markup


def nesting_depth(markup: str, *, limit: int = 1 << 30) -> int:
    """The deepest the parser's stack of open elements gets (<html> and <body> not counted),
    bounded above; _TooDeep past `limit`."""
    low = markup.lower()
    builder, pos = _Builder(limit), 0
    while (m := _TOKEN.search(low, pos)) is not None:
        if m.start() > pos:
            builder.reopen()  # text: formatting closed before it is reopened around it
        if m.group(2) is None:  # a comment: "<!-->" and "<!--->" are whole ones
            end = m.end() if low.startswith(">", m.end()) else m.end() + 1 if low.startswith("->", m.end()) else None
            if end is None:
                close = _COMMENT_END.search(low, m.end())
                end = close.end() - 1 if close else len(low)
            pos = end + 1
            continue
        gt = low.find(">", m.end())
        if gt < 0:
            break  # a tag cut off by the end of the page is dropped
        tag, pos = m.group(2), gt + 1
        if m.group(1):
            builder.end(tag)
            continue
        builder.start(tag, _self_closing(low[m.end():gt]))
        top = builder.stack[-1] if builder.stack else None
        if tag not in _RAW and tag != "plaintext" or top is None or top.name != tag or top.space:
            continue  # not text only (an SVG <title> or <style> holds tags)
        if tag == "plaintext":
            break  # the rest of the page is its text
        builder.pop_to(len(builder.stack) - 1)
        close = low.find("</" + tag, pos)
        pos = close if close >= 0 else len(low)
    return builder.deepest


def check_tree_depth(root, name: str, *, limit: int = MAX_DEPTH) -> None:
    """RalmError when the parsed tree under `root` is deeper than `limit`: the stack of open
    elements that `bounded_markup` bounds is not the tree where a table's misplaced content is
    moved out of it (foster parenting), and main-content extraction walks the tree."""
    level, node = 0, root.first_element_child
    while node is not None:  # a walk by sibling and parent links, in document order
        if level >= limit:
            raise RalmError(f"{name}: the HTML nests elements deeper than {limit} levels (as no page does); "
                            "refusing to read it")
        if (child := node.first_element_child) is not None:
            node, level = child, level + 1
            continue
        while node is not None and node.next_element_sibling is None:
            node, level = node.parent, level - 1
            if level < 0:
                return
        node = node.next_element_sibling if node is not None else None
