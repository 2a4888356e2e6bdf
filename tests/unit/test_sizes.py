"""sizes.py `mib`: the one byte formatter the ledger, the plan and `ratio: "auto"` print with."""
from zerokit.sizes import mib


def test_mib_formats_as_the_reports_print():
    assert mib(0) == "0.00 MiB"
    assert mib(3 * 2**19) == "1.50 MiB"
    assert mib(5 * 2**30) == "5,120.00 MiB"                 # the plan: grouped, 2 decimals
    assert mib(5 * 2**30, grouped=False) == "5120.00 MiB"   # the ledger's table columns
    assert mib(5 * 2**30 + 2**19, decimals=0) == "5,120 MiB"  # auto ratio's reason
