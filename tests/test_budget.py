import pytest
import torch

from lightning_tbp.remat.budget import AUTO_DEFAULT_FRACTION, MemoryBudget, format_bytes, parse_budget


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (0.4, MemoryBudget("fraction", 0.4)),
        (1.0, MemoryBudget("fraction", 1.0)),
        (123456, MemoryBudget("bytes", 123456)),
        ("6GiB", MemoryBudget("bytes", 6 * 1024**3)),
        ("512MiB", MemoryBudget("bytes", 512 * 1024**2)),
        ("1.5GB", MemoryBudget("bytes", 1_500_000_000)),
        ("300 kB", MemoryBudget("bytes", 300_000)),
        ("auto", MemoryBudget("auto")),
        ("AUTO", MemoryBudget("auto")),
        ("0.4", MemoryBudget("fraction", 0.4)),
        (" .25 ", MemoryBudget("fraction", 0.25)),
        ("1", MemoryBudget("fraction", 1.0)),
    ],
)
def test_accepted_forms(spec, expected) -> None:
    assert parse_budget(spec) == expected


@pytest.mark.parametrize(
    "spec", [0.0, 1.5, -0.2, 0, -5, True, "6 parsecs", "GiB", "", "0MiB", None, [0.5], "1.5", "0", "0.0", "-0.2", "2"]
)
def test_malformed_budgets_name_the_accepted_forms(spec) -> None:
    with pytest.raises(ValueError, match="'6GiB'"):
        parse_budget(spec)


def test_resolution() -> None:
    cpu = torch.device("cpu")
    assert parse_budget(0.25).resolve(1000, cpu) == 250
    assert parse_budget("1KiB").resolve(10**9, cpu) == 1024
    assert parse_budget("auto").resolve(1000, cpu) == int(AUTO_DEFAULT_FRACTION * 1000)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
