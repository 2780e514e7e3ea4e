# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`check`'s caller rule: no patch leaves a function, method or class it adds without a caller outside tests.

Upstream reviews each pull request on its own branch, so code that only a later pull request calls is dead code
there. The rule is checked on the series applied in order (each patch's commit holds the patches before it, a
superset of its branch), by name: a definition the series added is live when the series makes upstream's own code
(a function or class it did not add, or module-level code) read its name, or a live definition of its own reads it.
Names read only as strings (getattr) do not count, so such a definition needs a direct reference somewhere."""

import ast
import subprocess

from .common import UPSTREAM_TAG, git

ALWAYS_LIVE = {
    "__init__", "__call__", "__enter__", "__exit__", "__iter__", "__len__", "__getitem__", "__repr__", "__eq__",
    "__hash__", "__post_init__", "__del__", "__str__", "__next__", "__contains__",
    # io.RawIOBase's protocol, which io and torch.load's C++ file adapter call
    "readable", "readinto", "seekable"
}


def _definitions(source):
    """{qualified name: (name, names it reads)} for each function and class of a module, '<module>' for the rest;
    a nested definition is its own entry, so its reads are not its parent's."""
    found = {}

    def reads(node, owner):
        names = found.setdefault(owner, (owner.rsplit(".", 1)[-1], set()))[1]
        stack = [node]
        while stack:
            item = stack.pop()
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(item, owner)
                continue
            if isinstance(item, ast.Name):
                names.add(item.id)
            elif isinstance(item, ast.Attribute):
                names.add(item.attr)
            elif isinstance(item, ast.alias) and item.asname:
                aliases[item.asname] = item.name.rsplit(".", 1)[-1]
            stack.extend(ast.iter_child_nodes(item))

    def walk(node, parent):
        qualified = node.name if parent == "<module>" else f"{parent}.{node.name}"
        found[qualified] = (node.name, set())
        for child in node.body:
            reads(child, qualified)
        # Decorators, base classes and default values are read where the definition runs: in its parent.
        arguments = getattr(node, "args", None)
        defaults = arguments.defaults + [d for d in arguments.kw_defaults if d] if arguments else []
        for extra in node.decorator_list + getattr(node, "bases", []) + defaults:
            reads(extra, parent)

    aliases = {}
    found["<module>"] = ("<module>", set())
    for child in ast.parse(source).body:
        reads(child, "<module>")
    for _, names in found.values():  # a name read under an alias `import x as y` reads x
        names |= {aliases[name] for name in names & set(aliases)}
    return found


class _Trees:
    """Parsed definitions of each file version, read once by blob id (the series changes few files per patch)."""

    def __init__(self, repo):
        self.repo, self.parsed = repo, {}

    def definitions(self, commit, paths):
        listing = git(self.repo, "ls-tree", commit, "--", *paths) if paths else ""
        result = {}
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            blob = meta.split()[2]
            if blob not in self.parsed:
                source = subprocess.run(["git", "-C", str(self.repo), "cat-file", "blob", blob],
                                        capture_output=True,
                                        text=True,
                                        check=True).stdout
                self.parsed[blob] = _definitions(source)
            for qualified, entry in self.parsed[blob].items():
                result[(path, qualified)] = entry
        return result


def _dead(trees, base, commit):
    """The (path, qualified name) pairs the series added by `commit` that nothing live reads."""
    paths = [
        p for p in git(trees.repo, "diff", "--name-only", base, commit, "--", "deepspeed").split() if p.endswith(".py")
    ]
    now, before = trees.definitions(commit, paths), trees.definitions(base, paths)
    added = {key for key in now if key[1] != "<module>" and key not in before}
    live = set(now) - added

    def new_reads(key):
        """What upstream's own code already read cannot call what the series adds: `f.close()` is no caller of a
        new Reader.close. So an upstream definition counts only the names the series made it read."""
        return now[key][1] - before[key][1] if key in before else now[key][1]

    grew = True
    while grew:
        grew = False
        read = set().union(*(new_reads(key) for key in live))
        for key in added - live:
            path, qualified = key
            parent = (path, qualified.rsplit(".", 1)[0]) if "." in qualified else None
            if parent in added and parent not in live:
                continue
            if now[key][0] in read or now[key][0] in ALWAYS_LIVE:
                live.add(key)
                grew = True
    return added - live


def uncalled_definitions(repo, patch_names, base=UPSTREAM_TAG):
    """One problem per definition a patch leaves without a caller: at the commit of the patch that adds it (or that
    removes its last caller). `patch_names` are the series' file names, one per commit after `base`, in order."""
    commits = git(repo, "rev-list", "--reverse", f"{base}..HEAD").split()
    trees, problems, dead_before = _Trees(repo), [], set()
    for commit, name in zip(commits, patch_names):
        dead = _dead(trees, base, commit)
        for path, qualified in sorted(dead - dead_before):
            if "." in qualified and (path, qualified.rsplit(".", 1)[0]) in dead:
                continue  # its class or function is named already
            problems.append(f"{name}: {qualified} ({path}) has no caller outside tests on this patch's branch; "
                            "fold it into the patch that first calls it, or drop it")
        dead_before = dead
    return problems
