"""The docs site covers the code and the README's links land: every module at the top of
``orchestrator`` and every package has an API page (``::: name`` in ``docs/api/``), and every
relative link of README.md names a file that exists and, with ``#anchor``, a heading in it.

The site itself is checked by ``mkdocs build --strict`` in scripts/test.sh (a broken link
between pages, a page left out of the navigation, an API page whose module is gone); README.md
is outside the site, so its links are checked here."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documented_modules() -> set[str]:
    names = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for line in page.read_text().splitlines():
            if line.startswith(":::"):
                names.add(line.removeprefix(":::").strip())
    return names


def test_every_module_and_package_has_an_api_page() -> None:
    expected = {"envs", "sandboxes"}
    for path in (ROOT / "orchestrator").iterdir():
        if (path / "__init__.py").is_file():
            expected.add(f"orchestrator.{path.name}")
        elif path.suffix == ".py" and not path.name.startswith("_"):
            expected.add(f"orchestrator.{path.stem}")
    missing = sorted(expected - documented_modules())
    assert not missing, f"no page in docs/api/ documents {missing}: add '::: <module>' to one"


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*]", "", heading)  # code's underscores stay (a heading's are in code)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    in_code = False
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_the_readme_links_land() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(target), f"README.md links to {link}: no such heading"


def test_slug_matches_mkdocs() -> None:
    assert slug(" Speed on a real model") == "speed-on-a-real-model"
    assert slug(" Scaling: Ray, trainer ranks, LoRA") == "scaling-ray-trainer-ranks-lora"
    assert slug(" Benchmarks (`bench/`)") == "benchmarks-bench"
    assert slug(" Learning from a file: `experiment=dataset_smol`") == \
        "learning-from-a-file-experimentdataset_smol"


def test_the_configuration_reference_is_generated_from_the_schema_and_conf() -> None:
    from orchestrator.commands.config_reference import PAGE, page

    assert PAGE.read_text() == page(), (
        "docs/config-reference.md is out of date: run "
        "python -m orchestrator.commands.config_reference")


def test_the_policy_loss_table_is_generated_from_the_registry() -> None:
    """Adding a loss is its class and a YAML: its row in docs/algorithms.md comes from its
    registration (orchestrator.algo.losses.LOSSES), never typed by hand."""
    from orchestrator.algo.losses import LOSSES
    from orchestrator.commands.config_reference import LOSS_PAGE, loss_table, with_loss_table

    text = LOSS_PAGE.read_text()
    assert text == with_loss_table(text), (
        "docs/algorithms.md's loss table is out of date: run "
        "python -m orchestrator.commands.config_reference")
    assert all(f"| `{name}` (" in loss_table() for name in LOSSES) and len(LOSSES) >= 4
