"""Every link in README.md, docs/ and results/README.md leads somewhere: relative links name a file
or folder of the repository, ``#anchors`` a heading of the page, and every ``results/<run>`` the
pages cite is a run of the archive."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "results" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: [text](target) with an optional "title"; images too
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: a results run cited in prose or code spans: results/<folder or file>
RUN = re.compile(r"(?<![\w./-])results/([A-Za-z0-9_.-]+)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: pathlib.Path) -> list[str]:
    bad = []
    text = FENCE.sub("", page.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    for run in (r.rstrip(".") for r in RUN.findall(page.read_text())):
        if not (REPO / "results" / run).exists():
            bad.append(f"{page.relative_to(REPO)}: results/{run} (no such run)")
    return bad


def test_every_link_leads_somewhere():
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_checker_sees_broken_links_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "results" / "run_a").mkdir(parents=True)
    (tmp_path / "b.md").write_text("# Title\n## 5. The plan `table`\n```\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#5-the-plan-table) [gone](c.md) [bad anchor](b.md#not-a-heading)\n"
                    "[web](https://example.com) ![img](b.md) `results/run_a/x.json`, results/run_b.\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["a.md: c.md (no such file)", "a.md: b.md#not-a-heading (no such heading)",
                                  "a.md: results/run_b (no such run)"]


def test_every_results_run_is_dated_and_listed():
    """results/ holds one entry per run, named with the date it ran, each a row of results/README.md."""
    index = (REPO / "results" / "README.md").read_text()
    runs = [p.name for p in sorted((REPO / "results").iterdir()) if p.name not in ("README.md", "kernels.csv")]
    undated = [r for r in runs if not re.search(r"20\d\d-[01]\d-[0-3]\d", r)]
    unlisted = [r for r in runs if f"| `{r}{'/' if (REPO / 'results' / r).is_dir() else ''}`" not in index
                and not (r.endswith("_seed1") and "`..._seed1/`" in index)]
    assert not undated, f"results/ entries without a date in the name: {undated}"
    assert not unlisted, f"results/ entries missing from results/README.md: {unlisted}"
