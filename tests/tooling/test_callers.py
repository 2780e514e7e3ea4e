# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`check`'s caller rule (tools/patchtool/callers.py) on a scratch repository: a definition a patch adds is named
when nothing outside tests calls it on that patch's branch, at the patch that adds it or removes its last caller."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from patchtool.callers import uncalled_definitions  # noqa: E402

UPSTREAM = '''
def load(path):
    return open(path).read()
'''


def _commit(repo, files, message):
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], check=True)


def _series(tmp_path, *patches):
    repo = tmp_path / "tree"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _commit(repo, {"deepspeed/io.py": UPSTREAM}, "upstream")
    subprocess.run(["git", "-C", str(repo), "tag", "upstream"], check=True)
    for number, files in enumerate(patches, 1):
        _commit(repo, files, f"patch {number}")
    return uncalled_definitions(repo, [f"{number:04d}-p.patch" for number in range(1, len(patches) + 1)])


def test_a_helper_called_only_by_a_later_patch_is_named_at_the_patch_that_adds_it(tmp_path):
    helper = UPSTREAM + '''

class Reader:

    def read(self):
        return _checked(self)


def _checked(reader):
    return reader
'''
    caller = helper.replace("return open(path).read()", "return Reader().read()")
    problems = _series(tmp_path, {"deepspeed/io.py": helper}, {"deepspeed/io.py": caller})
    assert len(problems) == 2, problems  # the class (not each method) and the function it calls
    assert all(problem.startswith("0001-p.patch:") for problem in problems)
    assert "Reader (deepspeed/io.py)" in problems[0] and "_checked" in problems[1]


def test_tests_do_not_count_as_callers_and_a_removed_caller_is_named(tmp_path):
    called = UPSTREAM.replace("return open(path).read()", "return _read(path)") + '''

def _read(path):
    return open(path).read()
'''
    uncalled = called.replace("return _read(path)", "return open(path).read()")
    problems = _series(tmp_path, {
        "deepspeed/io.py": called,
        "tests/test_io.py": "from deepspeed.io import _read\n"
    }, {"deepspeed/io.py": uncalled})
    assert problems == [
        "0002-p.patch: _read (deepspeed/io.py) has no caller outside tests on this patch's branch; fold it into the "
        "patch that first calls it, or drop it"
    ]


def test_a_series_whose_additions_are_all_called_passes(tmp_path):
    new_module = "def plan(sizes):\n    return sorted(sizes)\n"
    caller = "from .planner import plan\n" + UPSTREAM.replace("open(path).read()", "plan(open(path).read())")
    assert _series(tmp_path, {"deepspeed/planner.py": new_module, "deepspeed/io.py": caller}) == []


def test_a_call_upstream_already_made_is_no_caller_of_a_new_method(tmp_path):
    """Upstream's `handle.close()` existed before the series: it cannot be the caller of a new Reader.close."""
    upstream = UPSTREAM.replace("return open(path).read()", "handle = open(path)\n    handle.close()")
    patched = upstream.replace("handle.close()", "handle.close()\n    return Reader().read()") + '''

class Reader:

    def read(self):
        return self

    def close(self):
        return None
'''
    repo = tmp_path / "tree"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _commit(repo, {"deepspeed/io.py": upstream}, "upstream")
    subprocess.run(["git", "-C", str(repo), "tag", "upstream"], check=True)
    _commit(repo, {"deepspeed/io.py": patched}, "patch 1")
    problems = uncalled_definitions(repo, ["0001-p.patch"])
    assert [problem.split(" has no caller")[0]
            for problem in problems] == ["0001-p.patch: Reader.close (deepspeed/io.py)"]


def test_defaults_aliases_and_nested_definitions_are_callers(tmp_path):
    new_module = '''def _key(item):
    return item


def plan(sizes, key=_key):
    def by_size(item):
        return key(item)

    return sorted(sizes, key=by_size)
'''
    caller = "from .planner import plan as make_plan\n" + UPSTREAM.replace("open(path).read()",
                                                                           "make_plan(open(path).read())")
    assert _series(tmp_path, {"deepspeed/planner.py": new_module, "deepspeed/io.py": caller}) == []


def test_a_description_over_1000_words_with_its_legend_is_refused(tmp_path):
    """`check` counts what upstream reads: the message plus the legend `branches` adds: 1,000 words pass, 1,001 not."""
    from patchtool.check import dependency_closures, long_descriptions
    from patchtool.description import BRANCH_PREFIX, pr_description
    from patchtool.common import patch_number, read_series, series_message
    names = (ROOT / "patches" / "series").read_text().split()[:5]
    for name in names:
        (tmp_path / name).write_text((ROOT / "patches" / name).read_text())
    (tmp_path / "series").write_text("".join(f"{name}\n" for name in names))
    series = read_series(tmp_path)
    last, original = series[-1], series[-1].read_text()

    def pad_to(total):
        described = pr_description(series_message(last), patch_number(last), series, BRANCH_PREFIX, {},
                                   dependency_closures(series))
        padding = total - len(described.split())
        last.write_text(original.replace("\n---\n", "\n" + " word" * padding + "\n---\n", 1))
        return long_descriptions(tmp_path, series)

    assert pad_to(1000) == []
    last.write_text(original)
    problems = pad_to(1001)
    assert len(problems) == 1 and problems[0].startswith(f"{names[-1]}: its pull request description")
    assert "is 1001 words" in problems[0]
