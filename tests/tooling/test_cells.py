# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The validated-cells matrix: what the recorder writes for passed, failed, skipped and deselected
tests, and the markdown that tools/cells.py prints from it."""

import importlib.util
import json
from pathlib import Path

TOOLS_CELLS = Path(__file__).resolve().parents[2] / "tools" / "cells.py"

SAMPLE_TESTS = '''
import pytest


@pytest.mark.cell(feature="resume", stage=3, precision="bf16")
class TestResume:

    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    def test_table(self, checkpoint):
        assert checkpoint != "universal"

    @pytest.mark.cell(offload="nvme", checkpoint=["rigid", "universal"])
    def test_nvme(self):
        pytest.skip("no libaio")

    @pytest.mark.parametrize("stage, precision", [(1, "fp16"), (2, "bf16")])
    def test_zero12(self, stage, precision):
        pass

    def test_deselected(self):
        pass


def test_without_cell_is_not_recorded():
    pass
'''


def load_tool():
    spec = importlib.util.spec_from_file_location("tools_cells", TOOLS_CELLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_sample(pytester, tmp_path):
    results = tmp_path / "cells.json"
    pytester.makeconftest(f'''
import pytest
from unit.cells import CellRecorder

def pytest_configure(config):
    config.addinivalue_line("markers", "cell(**axes): cell")
    config.pluginmanager.register(CellRecorder("fork", {str(results)!r}), "cells")
''')
    pytester.makepyfile(test_sample=SAMPLE_TESTS)
    pytester.runpytest_inprocess("-k", "not deselected", "-p", "no:cacheprovider").assert_outcomes(passed=4,
                                                                                                   failed=1,
                                                                                                   skipped=1)
    return json.loads(results.read_text())


def test_recorder_outcomes_and_cells(pytester, tmp_path):
    tests = run_sample(pytester, tmp_path)["tests"]
    outcome = {nodeid.split("::")[-1]: test["outcome"] for nodeid, test in tests.items()}
    assert outcome == {
        "test_table[rigid]": "passed",
        "test_table[universal]": "failed",
        "test_nvme": "skipped",
        "test_zero12[1-fp16]": "passed",
        "test_zero12[2-bf16]": "passed",
        "test_deselected": "not run",
    }
    nvme = tests["test_sample.py::TestResume::test_nvme"]["cells"]
    assert [c["checkpoint"] for c in nvme] == ["rigid", "universal"]
    assert {c["offload"] for c in nvme} == {"nvme"}
    assert tests["test_sample.py::TestResume::test_zero12[1-fp16]"]["cells"] == [
        dict(feature="resume",
             stage="1",
             precision="fp16",
             offload="none",
             checkpoint="-",
             layout="none",
             settings="defaults")
    ]


def test_matrix_statuses(pytester, tmp_path):
    table = load_tool().matrix(run_sample(pytester, tmp_path)).splitlines()
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:8]) for line in table[2:] if "|" in line}
    assert ("resume", "3", "bf16", "none", "rigid", "none", "defaults", "validated") in rows
    assert ("resume", "3", "bf16", "none", "universal", "none", "defaults", "FAILED") in rows
    assert ("resume", "3", "bf16", "nvme", "universal", "none", "defaults", "not run") in rows
    assert ("resume", "1", "fp16", "none", "-", "none", "defaults", "validated") in rows
    assert ("resume", "3", "bf16", "none", "-", "none", "defaults", "not run") in rows  # test_deselected
    assert table[0].startswith("| feature | ZeRO stage | precision | offload | checkpoint | layout change | settings")


def test_matrix_where_filters(pytester, tmp_path):
    tool = load_tool()
    table = tool.matrix(run_sample(pytester, tmp_path), "resume", tool.parse_where(["stage=1,2"]))
    rows = [line for line in table.splitlines()[2:] if line.startswith("| resume")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]


MANIFEST_TESTS = '''
import pytest


class TestResume:

    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    def test_table(self, checkpoint):
        pass

    def test_table_other(self):
        pass

    @pytest.mark.parametrize("layout", ["dp4->dp2"])
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n, layout):
        pass
'''


def test_manifest_keys_by_test_id_longest_wins(pytester):
    """The manifest (unit/cell_manifest.py) gives a test's cell without markers: every key over the test's id
    applies, longer keys override shorter ones, a key is not a prefix of a longer name, and parametrize arguments
    named after an axis still fill it."""
    from unit.cells import cells_of
    pytester.makepyfile(test_sample=MANIFEST_TESTS)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    manifest = {
        "test_sample.py": dict(feature="resume", stage=3, precision="bf16"),
        "test_sample.py::TestResume::test_table": dict(offload="nvme"),
        "test_sample.py::TestResume::test_param[1-dp4->dp2]": dict(stage=1),
    }
    cells = {item.nodeid.split("::")[-1]: cells_of(item, manifest) for item in items}
    assert [c["checkpoint"]
            for c in cells["test_table[rigid]"] + cells["test_table[universal]"]] == ["rigid", "universal"]
    assert {c["offload"] for c in cells["test_table[rigid]"]} == {"nvme"}
    assert cells["test_table_other"] == [
        dict(feature="resume",
             stage="3",
             precision="bf16",
             offload="none",
             checkpoint="-",
             layout="none",
             settings="defaults")
    ]
    assert [(c["stage"], c["layout"]) for c in cells["test_param[1-dp4->dp2]"]] == [("1", "dp4->dp2")]
    assert [c["stage"] for c in cells["test_param[2-dp4->dp2]"]] == ["3"]


def test_the_matrix_is_published_in_docs_cells_md(tmp_path):
    """`tools/cells.py --update` without a file rewrites docs/cells.md, the page that holds the markers (the README
    links to it); only the block between the markers changes."""
    tool = load_tool()
    assert tool.DOC == TOOLS_CELLS.parents[1] / "docs" / "cells.md"
    published = tool.DOC.read_text()
    assert published.count(tool.BEGIN) == 1 and published.count(tool.END) == 1
    assert tool.BEGIN not in (TOOLS_CELLS.parents[1] / "README.md").read_text()
    page = tmp_path / "cells.md"
    page.write_text(f"# Cells\n\n{tool.BEGIN}\nold\n{tool.END}\n\nAfter.\n")
    tool.update(page, "| new |")
    assert page.read_text() == f"# Cells\n\n{tool.BEGIN}\n| new |\n{tool.END}\n\nAfter.\n"
