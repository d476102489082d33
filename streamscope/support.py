"""Support tables: which values a model serves, and why it does not serve the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

SERVED = "served"


@dataclass
class BlockSupport:
    """One block's (or the model root's) values: None where served, else the reason it is not."""

    where: str
    rows: dict[str, Optional[str]]

    def __getitem__(self, name: str) -> Optional[str]:
        return self.rows[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def served(self) -> list[str]:
        """The names of the values served."""
        return [name for name, reason in self.rows.items() if reason is None]

    def unavailable(self) -> dict[str, str]:
        """The values not served, with their reasons."""
        return {name: reason for name, reason in self.rows.items() if reason is not None}

    def lines(self, width: int) -> list[str]:
        return [f"  {name:<{width}} {SERVED if reason is None else 'unavailable: ' + reason}"
                for name, reason in self.rows.items()]

    def __str__(self) -> str:
        width = max(map(len, self.rows), default=0)
        return "\n".join([self.where, *self.lines(width)])


@dataclass
class ModelSupport:
    """A model's support table: its root values, then each run of blocks that serve alike."""

    title: str
    root: BlockSupport
    blocks: list[BlockSupport] = field(default_factory=list)

    def __getitem__(self, index: int) -> BlockSupport:
        return self.blocks[index]

    def __str__(self) -> str:
        width = max((len(name) for table in [self.root, *self.blocks] for name in table.rows), default=0)
        lines = [self.title, *self.root.lines(width)]
        start = 0
        while start < len(self.blocks):
            end = start
            while end + 1 < len(self.blocks) and self.blocks[end + 1].rows == self.blocks[start].rows:
                end += 1
            span = f"{start}" if start == end else f"{start}-{end}"
            lines.append(f"model.layers[{span}]")
            lines.extend(self.blocks[start].lines(width))
            start = end + 1
        return "\n".join(lines)
