"""Self-describing tables: what a benchmark or a selftest returns, so the Go
host prints any of them (as a table or JSON) without knowing their rows.

A table is {"columns": [column, ...], "rows": [{name: value}, ...]}; each
column says its name (the row key), unit, what it means, the header the text
table uses and whether the text table shows it (JSON always has every column).
Units the host knows how to print: "ms", "s", "bytes", "GB/s", "%", "x"
(a ratio) and "" (a count, a size, a name).
"""

from dataclasses import asdict, dataclass

UNITS = ("", "ms", "s", "bytes", "GB/s", "%", "x")


@dataclass(frozen=True)
class Column:
    name: str
    unit: str
    doc: str
    label: str = ""  # header in the text table; default: the name
    show: bool = True  # in the text table (JSON has every column)

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"column {self.name!r}: unit {self.unit!r} is not one of {UNITS}")

    def describe(self) -> dict:
        out = asdict(self)
        out["label"] = self.label or self.name
        return out


def table(columns, rows: list[dict]) -> dict:
    """The wire form of a table; every row gets every column (None if missing)."""
    names = [c.name for c in columns]
    extra = sorted({key for row in rows for key in row} - set(names))
    if extra:
        raise ValueError(f"rows have keys no column describes: {extra}")
    return {"columns": [c.describe() for c in columns], "rows": [{n: row.get(n) for n in names} for row in rows]}
