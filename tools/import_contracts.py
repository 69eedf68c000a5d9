"""An import-linter contract type for ``make lint``: no import circle between any two modules.

import-linter's own ``acyclic_siblings`` contract squashes each subpackage into one node, so it judges
packages, not modules; privfl's rule is about modules (an import circle between two modules is what
makes one impossible to read, test or move without the other). This contract takes import-linter's
graph (grimp, every import: module level, inside functions and under ``TYPE_CHECKING``) of the
``containers`` and reports each strongly connected component of more than one module, with the
imports that make it. The layers and independence contracts in ``.importlinter`` say which way the
former circles now point.
"""

from __future__ import annotations

from typing import cast

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicModulesContract(Contract):
    """Modules under ``containers`` import each other without a circle."""

    type_name = "acyclic_modules"
    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        roots = tuple(str(c) for c in cast("list[str]", self.containers))
        modules = sorted(m for m in graph.modules if m.startswith(roots))
        inside = set(modules)
        edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in inside) for m in modules}
        circles = [c for c in _strongly_connected(modules, edges) if len(c) > 1]
        details = []
        for circle in circles:
            members = set(circle)
            details.append({"modules": circle, "imports": [(a, b) for a in circle for b in edges[a] if b in members]})
        return ContractCheck(kept=not circles, metadata={"circles": details})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for circle in check.metadata["circles"]:
            output.print_error(f"import circle of {len(circle['modules'])} modules: {', '.join(circle['modules'])}", bold=True)
            for importer, imported in circle["imports"]:
                output.indent_cursor()
                output.print_error(f"{importer} -> {imported}")
            output.new_line()


def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (deep import chains would exhaust Python's recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out
