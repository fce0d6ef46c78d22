"""The documentation site builds without warnings and works offline (every link resolves to a file, diagrams
render without the internet), its pages fit a 1,280 px screen in headless Chromium (their links and images work
there too), its code uses only arguments that exist, and every generated benchmark table is stamped by a command
``make bench`` or ``make bench-full`` runs."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_hdet
from lightning_hdet import (
    PBT,
    AsyncLocalSGDStrategy,
    Best,
    ElasticDDPWorkerStrategy,
    ElasticWorkerStrategy,
    HDETCallback,
    HDETFabricStrategy,
    HDETFSDPStrategy,
    HDETLoop,
    HDETReplay,
    HDETStrategy,
    OuterService,
    SafetyNet,
    Search,
    SlowRanks,
    Softmax,
    experimental,
)
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.demos import CharCorpusDataModule, CharLM

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Classes whose keyword arguments the docs use; **kwargs of the strategies go to DDPStrategy.
SIGNATURES = {
    "HDETStrategy": (HDETStrategy, DDPStrategy),
    "HDETFSDPStrategy": (HDETFSDPStrategy,),
    "HDETCallback": (HDETCallback,),
    "AsyncLocalSGDStrategy": (AsyncLocalSGDStrategy, DDPStrategy),
    **{name: (getattr(lightning_hdet, name),) for name in ("DelayedNesterov", "Nesterov", "SparseLoCo", "PushCheck",
                                                           "Int8", "TopK")},
    "ElasticWorkerStrategy": (ElasticWorkerStrategy, SingleDeviceStrategy),
    "ElasticDDPWorkerStrategy": (ElasticDDPWorkerStrategy, DDPStrategy),
    "OuterService": (OuterService, OuterSettings),
    "SlowRanks": (SlowRanks,),
    "CharLM": (CharLM,),
    "CharCorpusDataModule": (CharCorpusDataModule,),
    "Trainer": (Trainer,),
    "PBT": (PBT,),
    "Softmax": (Softmax,),
    "Best": (Best,),
    "Search": (Search,),
    "SafetyNet": (SafetyNet,),
    **{name: (getattr(experimental, name),) for name in experimental.__all__},
    "Fabric": (Fabric,),
    "HDETReplay": (HDETReplay,),
    "HDETFabricStrategy": (HDETFabricStrategy, FabricDDPStrategy),
    "HDETLoop": (HDETLoop,),
    "AsyncLocalSGDFabricStrategy": (OuterSettings, FabricDDPStrategy, AsyncLocalSGDStrategy),
}
# The rules', outer optimizers' and codecs' objects a doc may pass as an argument value: built too, so their values
# are checked.
RULES = {name: getattr(lightning_hdet, name, None) or getattr(experimental, name)
         for name in ("PBT", "Softmax", "Best", "Search", "SafetyNet", "DelayedNesterov", "Nesterov", "SparseLoCo",
                      "PushCheck", "NoCodec", "BF16", "Int8", "TopK", *experimental.__all__)}

# Built from the literal arguments a doc shows; all validate their arguments in ``__init__``.
CONSTRUCTIBLE = ("HDETStrategy", "HDETCallback", "AsyncLocalSGDStrategy", "SlowRanks", "ElasticWorkerStrategy",
                 "ElasticDDPWorkerStrategy", "HDETFabricStrategy")


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, match in enumerate(FENCE.finditer(page.read_text())):
            blocks.append((f"{page.relative_to(ROOT)}#{i}", match.group(1)))
    return blocks


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module's tests (the build is most of their time)."""
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return site


def test_site_builds_strict(site: Path) -> None:
    # API pages are generated from the docstrings, and example files are included into the pages.
    api = (site / "api" / "strategy.html").read_text()
    assert "gradient_sync" in api and "set_lr_multipliers" in api
    assert "every_n_steps" in (site / "api" / "callback.html").read_text()
    recipes = (site / "recipes.html").read_text()
    assert "lightning_hdet.HDETStrategy" in recipes and "#SBATCH" in recipes
    assert not [p for p in site.rglob("*.html") if "--8&lt;--" in p.read_text() or "--8<--" in p.read_text()]
    assert 'class="mermaid"' in (site / "concepts.html").read_text()


class _Page(HTMLParser):
    """The links, scripts and stylesheets of one page, and the text of its Mermaid diagrams and code."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.loads: list[str] = []  # what the browser fetches on its own: scripts, stylesheets, images
        self.mermaid: list[str] = []
        self._in_mermaid = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag in ("script", "img") and a.get("src"):
            self.loads.append(a["src"])
        if tag == "link" and a.get("href") and a.get("rel") in ("stylesheet", "preload", "preconnect"):
            self.loads.append(a["href"])
        if self._in_mermaid:
            self._in_mermaid += 1
        elif "mermaid" in (a.get("class") or "").split():
            self._in_mermaid = 1
            self.mermaid.append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_mermaid = max(self._in_mermaid - 1, 0)

    def handle_data(self, data: str) -> None:
        if self._in_mermaid:
            self.mermaid[-1] += data


def parse(page: Path) -> _Page:
    parser = _Page()
    parser.feed(page.read_text())
    return parser


@pytest.fixture(scope="module")
def pages(site: Path) -> dict[Path, _Page]:
    """Every page of the site, parsed once (404.html is only ever shown by a web server: its links are
    absolute, from the server's root)."""
    return {page: parse(page) for page in sorted(site.rglob("*.html")) if page.name != "404.html"}


def _local(url: str) -> bool:
    parts = urlsplit(url)
    return not parts.scheme and not parts.netloc and bool(parts.path)


def test_every_internal_link_resolves_to_a_file_and_nothing_is_fetched_from_the_internet(
    site: Path, pages: dict[Path, _Page]
) -> None:
    broken, remote = [], []
    for page, parsed in pages.items():
        for url in parsed.links + parsed.loads:
            if _local(url):
                target = (page.parent / unquote(urlsplit(url).path)).resolve()
                if not target.is_file():  # a folder opened from disk is a bare directory listing
                    broken.append(f"{page.relative_to(site)} -> {url}")
        remote += [f"{page.relative_to(site)} loads {u}" for u in parsed.loads if urlsplit(u).scheme in ("http", "https")]
    assert not broken, broken[:20]
    assert not remote, remote[:20]


# The first line of a Mermaid diagram's source (the kinds our pages draw).
MERMAID_START = re.compile(r"^\s*(sequenceDiagram|flowchart [A-Z]{2}|graph [A-Z]{2})\b", re.M)


def test_mermaid_diagrams_are_rendered_by_the_bundled_script(pages: dict[Path, _Page]) -> None:
    """Every diagram's source is inside a Mermaid element (none left as a code block) of a page that loads the
    bundled Mermaid, which Material uses instead of its CDN copy."""
    with_diagrams = []
    for page, parsed in pages.items():
        text = page.read_text()
        raw = len(MERMAID_START.findall(re.sub(r"<[^>]+>", "", text)))
        if not raw:
            continue
        with_diagrams.append(page.name)
        assert sum(bool(MERMAID_START.search(m)) for m in parsed.mermaid) == raw, f"{page.name}: raw diagram text"
        scripts = [(page.parent / s).resolve() for s in parsed.loads if _local(s)]
        assert any(s.name == "mermaid.min.js" and s.is_file() for s in scripts), page.name
    assert {"concepts.html", "async.html"} <= set(with_diagrams)


# Headless Chromium as CI runs it (`.ci/run` installs Debian's `chromium` when it is missing, and sets
# HDET_REQUIRE_BROWSER=1 so that a missing browser fails the browser checks instead of skipping them). Without the
# background-networking flags it waits on the closed network; a fresh profile per run keeps runs independent.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-proxy-server", "--window-size=1280,900")


def chromium(profile: Path, *args: str) -> list[str]:
    """The command line of a headless Chromium with its own fresh profile under ``profile``."""
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("HDET_REQUIRE_BROWSER"):
            pytest.fail("headless Chromium is not installed: `apt-get install chromium` (.ci/run does it)")
        pytest.skip("headless Chromium is not installed (`apt-get install chromium`; .ci/run installs it); "
                    "the HTML checks above still ran")
    return [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]


def test_diagrams_render_offline_in_headless_chromium(site: Path, tmp_path: Path) -> None:
    """Opened from disk, as the README says: Material replaces each diagram's source by the drawn one."""
    names = ("concepts.html", "async.html")
    browsers = {name: subprocess.Popen(  # in parallel: most of a run is Chromium starting
        chromium(tmp_path / name, "--virtual-time-budget=2000", "--dump-dom", (site / name).as_uri()),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for name in names}
    for name, browser in browsers.items():
        dom = browser.communicate(timeout=120)[0]
        diagrams = len([m for m in parse(site / name).mermaid if MERMAID_START.search(m)])
        assert "</html>" in dom, name
        assert not MERMAID_START.search(re.sub(r"<[^>]+>", "", dom)), f"{name}: a diagram is raw text"
        assert "Syntax error in text" not in dom, f"{name}: Mermaid could not read a diagram"
        assert dom.count('<div class="mermaid">') == diagrams, name


CHECKER = Path(__file__).with_name("browser_check.js")
# What fits a code block of a page at 1,280 px without scrolling (docs/stylesheets/extra.css): the browser check
# sees it, test_code_lines_fit_the_page holds every block written in a page to it.
MAX_CODE_LINE = 88


def browser_check(root: Path, pages: list[str], profile: Path, timeout: float = 240) -> dict:
    """Open ``pages`` (paths under ``root``) in headless Chromium at 1,280 px, from a local web server, and return
    what tests/browser_check.js reports: per page the content wider than the viewport or cut off, and the images
    that did not load; every internal link to a missing file or anchor."""
    extras = {"/__check__.html": b'<!doctype html><body style="margin:0"><script src="__check__.js"></script>',
              "/__check__.js": CHECKER.read_bytes(),
              "/__pages__.json": json.dumps({"pages": pages, "maxCodeLine": MAX_CODE_LINE}).encode()}
    report: dict = {}
    done = threading.Event()

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in extras:
                return super().do_GET()
            self.send_response(200)
            self.send_header("Content-Type", "application/javascript" if self.path.endswith(".js") else "text/html")
            self.end_headers()
            self.wfile.write(extras[self.path])

        def do_POST(self) -> None:
            report.update(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()
            done.set()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    browser = subprocess.Popen(chromium(profile, f"http://127.0.0.1:{server.server_port}/__check__.html"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert done.wait(timeout), f"headless Chromium sent no report in {timeout:.0f} s"
    finally:
        browser.kill()
        browser.wait()
        server.shutdown()
        server.server_close()
    assert "error" not in report, report.get("error")
    return report


def _problems(report: dict) -> list[str]:
    out = [f"{page['url']}: {problem}" for page in report["pages"] for problem in page["wide"]]
    out += [f"{page['url']}: image {src} did not load" for page in report["pages"] for src in page["images"]]
    return out + [f"broken link {link}" for link in report["broken"]]


def test_every_page_fits_1280_px_and_its_links_and_images_work_in_headless_chromium(
    site: Path, tmp_path: Path
) -> None:
    """Every page in a real browser at 1,280 px: nothing wider than the viewport or cut off (wide tables and code
    scroll inside their box), every image loads, every internal link and #anchor leads somewhere."""
    pages = [p.relative_to(site).as_posix() for p in sorted(site.rglob("*.html")) if p.name != "404.html"]
    report = browser_check(site, pages, tmp_path / "profile")
    assert sorted(page["url"] for page in report["pages"]) == pages
    assert not _problems(report), "\n".join(_problems(report)[:30])


def test_browser_check_sees_a_wide_page_a_cut_off_table_a_broken_image_and_a_broken_link(tmp_path: Path) -> None:
    """And a narrow table or a code block of short lines that scrolls where it could fit (wrap, or the font)."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "ok.html").write_text('<p id="here">fits</p><img src="img.svg">')
    (root / "img.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>')
    (root / "bad.html").write_text(
        '<div style="width:2000px">wide</div><div style="width:300px;overflow:hidden"><table><tr>'
        '<td style="min-width:900px">cut</td></tr></table></div><img src="missing.png">'
        '<a href="ok.html#here">fine</a> <a href="ok.html#gone">anchor</a> <a href="none.html">file</a>'
        '<div style="width:300px;overflow-x:auto"><table><tr><td style="min-width:600px">narrow</td></tr></table></div>'
        '<pre><code style="display:block;width:100px;overflow:auto;font-size:40px">short lines</code></pre>')
    problems = _problems(browser_check(root, ["bad.html", "ok.html"], tmp_path / "profile", timeout=120))
    assert [p for p in problems if p.startswith("ok.html")] == []
    assert any("the page is" in p and "wide" in p for p in problems), problems
    assert any('"cut" is cut off' in p for p in problems), problems
    assert any("image missing.png did not load" in p for p in problems), problems
    assert any(p.endswith("ok.html#gone (no such anchor)") for p in problems), problems
    assert any(p.endswith("none.html (no such file)") for p in problems), problems
    assert not any("#here" in p for p in problems), problems
    assert any('table of 1 columns scrolls (' in p and '"narrow"' in p for p in problems), problems
    assert any("code block of 11-character lines scrolls" in p for p in problems), problems


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_python_block_uses_real_arguments(where: str, code: str) -> None:
    tree = ast.parse(code)  # a syntax error in a doc block fails here
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in SIGNATURES:
            continue
        allowed = {p for cls in SIGNATURES[name] for p in inspect.signature(cls.__init__).parameters}
        for kw in node.keywords:
            if kw.arg is not None:
                assert kw.arg in allowed, f"{where}: {name}({kw.arg}=...) is not an argument of {name}"
        if name in CONSTRUCTIBLE:
            try:
                args = [_value(a) for a in node.args]
                kwargs = {kw.arg: _value(kw.value) for kw in node.keywords}
            except ValueError:
                continue  # not all literal (e.g. a variable): the names were checked above
            SIGNATURES[name][0](*args, **kwargs)  # the values shown are accepted (validation runs here)


def _value(node: ast.expr) -> object:
    """A literal, or a rule object built from literals (``vote=PBT(quantile=0.25)``); ``ValueError`` otherwise."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in RULES:
        args, kwargs = [_value(a) for a in node.args], {k.arg: _value(k.value) for k in node.keywords}
        try:
            return RULES[node.func.id](*args, **kwargs)
        except (TypeError, ValueError) as err:  # a value the doc shows is refused: not "not literal"
            raise AssertionError(f"{ast.unparse(node)}: {err}") from err
    return ast.literal_eval(node)


def test_blocks_were_found() -> None:
    assert len(python_blocks()) >= 10




def code_lines(page: Path) -> list[tuple[int, str]]:
    """The lines inside the fenced code blocks written in ``page``, as shown (the fence's indent removed). Left
    out: Mermaid diagrams (drawn, not shown as code) and whole example files included with ``--8<--`` (code
    of the repository, formatted to its own line length; they scroll in their block)."""
    lines, fence, shown = [], None, True
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.lstrip()
        if fence is None:
            if stripped.startswith("```"):
                fence, shown = len(line) - len(stripped), stripped != "```mermaid"
        elif stripped.startswith("```"):
            fence = None
        elif shown and not stripped.startswith("--8<--"):
            lines.append((number, line[fence:]))
    return lines


def test_code_lines_fit_the_page() -> None:
    docs = PAGES  # the README too: it is the first page most users read
    too_long = [f"{page.relative_to(ROOT)}:{n} ({len(line)})" for page in docs for n, line in code_lines(page)
                if len(line) > MAX_CODE_LINE]
    assert not too_long, f"code lines over {MAX_CODE_LINE} characters: {too_long}"
    assert sum(len(code_lines(page)) for page in docs) > 100  # the blocks were found


def test_code_lines_check_sees_a_long_line(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("text " * 40 + "\n\n  ```bash\n  " + "x" * 89 + "\n  ok\n  ```\n\n```\n--8<-- \"f\"\n```\n"
                    "```mermaid\n" + "y" * 100 + "\n```\n")
    assert [(n, len(line)) for n, line in code_lines(page)] == [(4, 89), (5, 2)]


USER_DOCS_WORDS = 25_000  # docs/*.md and docs/api/*.md, as `wc -w` counts them (not the research log)


def test_user_docs_stay_within_their_word_budget() -> None:
    pages = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "api").glob("*.md")]
    words = sum(len(page.read_text().split()) for page in pages)
    assert 10_000 < words <= USER_DOCS_WORDS, (
        f"docs/*.md hold {words} words (budget {USER_DOCS_WORDS}): move research-like text and long generated "
        "tables to docs/research/, leaving the reading and a link (make bench rewrites a block where it stands)")


def _nav_pages(items: list) -> list[str]:
    out = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _linked_pages(markdown: str, prefix: str = "") -> set[str]:
    """The docs pages a piece of markdown links to (``prefix``: where docs/ is from the linking file)."""
    return {m[len(prefix):] for m in re.findall(r"\]\(([^)#\s]+\.md)", markdown) if m.startswith(prefix)}


def test_index_lists_every_page_and_agrees_with_the_readme() -> None:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    nav = set(_nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader)["nav"])) - {"index.md"}
    assert nav == {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")} - {"index.md"}
    index = (ROOT / "docs" / "index.md").read_text().split("## Pages", 1)[1].split("\n## ", 1)[0]
    assert _linked_pages(index) == nav, "docs/index.md's Pages must list every page of the site's nav"
    readme = (ROOT / "README.md").read_text().split("## Documentation", 1)[1].split("\n## ", 1)[0]
    assert _linked_pages(readme, "docs/") - {"index.md"} == nav, "README's Documentation must list the same pages"


def stamp_problem(body: str) -> str | None:
    """What is wrong with a generated block's stamp (its last line), ``None`` when nothing is. A legacy stamp
    (a block generated before stamps existed) says what its results file recorded, ``commit unknown``."""
    from benchmarks.common import STAMP
    from benchmarks.run_all import commands

    lines = body.strip().splitlines()
    m = STAMP.match(lines[-1]) if lines else None
    if m is None:
        return "its last line is not a stamp (benchmarks/common.py's stamp() writes one under every table)"
    if m["legacy"]:
        return None if m["commit"] == "unknown" else "a legacy stamp's commit is 'unknown' (else: a full stamp)"
    if not re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", m["commit"]):
        return f"commit {m['commit']!r} is not a commit"
    if m["command"] not in commands(full=True):
        return (f"command {m['command']!r} is not one that `make bench` or `make bench-full` runs "
                "(`python benchmarks/run_all.py --list`)")
    unknown = [field for field in ("date", "machine", "seeds", "wall") if "unknown" in m[field]]
    return f"{unknown} unknown in a full stamp" if unknown else None


def generated_blocks() -> list[tuple[str, str]]:
    from benchmarks.cache import BLOCK

    return [(f"{page.relative_to(ROOT)}:{m['name']}", m["body"]) for page in PAGES
            for m in BLOCK.finditer(page.read_text())]


@pytest.mark.parametrize(("where", "body"), generated_blocks(), ids=[w for w, _ in generated_blocks()])
def test_generated_table_is_stamped_by_a_bench_command(where: str, body: str) -> None:
    assert stamp_problem(body) is None, f"{where}: {stamp_problem(body)}"


def test_stamp_check_refuses_a_missing_stamp_or_a_command_make_bench_does_not_run() -> None:
    from benchmarks.run_all import commands

    table = "| a |\n|---|\n| 1 |\n\n"
    full = ("*Stamp · commit 0123456789 · command `{}` · date 2026-12-01 20:00 UTC · machine 2 cores, Linux, "
            "Python 3.11.7, torch 2.13.0, lightning 2.6.6 · seeds 0–2 · wall-clock 12 min*")
    assert "not a stamp" in stamp_problem(table)
    assert stamp_problem(table + full.format(commands(full=False)[0])) is None
    assert stamp_problem(table + full.format(commands(full=True)[-1]).replace("0123456789", "0123456789+dirty")) is None
    assert "not one that `make bench`" in stamp_problem(table + full.format("python benchmarks/crash.py --quick"))
    legacy = full.replace("*Stamp ·", "*Stamp (legacy) ·").format("python benchmarks/crash.py --merge a.json")
    assert "legacy stamp's commit" in stamp_problem(table + legacy)
    assert stamp_problem(table + legacy.replace("commit 0123456789", "commit unknown")) is None
    assert "['seeds'] unknown" in stamp_problem(table + full.format(commands()[0]).replace("0–2", "unknown"))
