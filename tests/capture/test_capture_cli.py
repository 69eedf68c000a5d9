"""``privfl.capture`` on a real run: ``list`` and ``verify``, which finds a flipped byte in a blob."""

from __future__ import annotations

from privfl.capture import TensorStore
from privfl.cli import run_cli
from tests.helpers import QUICK, needs_fmnist, train


@needs_fmnist
def test_capture_cli_verify_detects_flipped_byte(tmp_path, capsys):
    from privfl.capture.__main__ import main as capture_main

    run = train(tmp_path, "fedre", *QUICK)
    assert capture_main(["--run", str(run), "verify"]) == 0
    assert capture_main(["--run", str(run), "list", "--kind", "ent_rep"]) == 0
    out = capsys.readouterr().out
    assert out.count("ent_rep") == 10
    rec = TensorStore(run / "capture", "capture").records()[-1]
    blob = TensorStore(run / "capture", "capture").blob_path(rec["sha256"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert capture_main(["--run", str(run), "verify"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    code = run_cli("privfl.capture", lambda: capture_main(["--run", str(run), "list", "--kind", "weights"]))
    assert code == 2 and "ent_rep" in capsys.readouterr().err
