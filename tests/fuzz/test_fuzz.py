"""Fuzzing in the suite: seeded mutations of real descriptors, files, streams, protocol
sessions and client certificates (``tests/fuzz/targets.py``).  Every input must end in
success or a HurrayError, within 10 s and within twice its size in memory (plus a fixed
allowance).

Under CI (``CI`` set) the seed is fixed, so every run replays the same inputs; elsewhere
each run draws a new seed and prints it with any finding.  ``make fuzz`` runs the same
targets for longer, coverage-guided (atheris)."""

from __future__ import annotations

import os
import time

import pytest

from tests.fuzz import targets

COUNTS = {"descriptor": 20000, "hrry": 6000, "stream": 8000, "protocol": 5000,
          "tenant": 20000}


@pytest.fixture(scope="module", autouse=True)
def _live_server():
    yield
    targets._LiveServer.stop()


@pytest.mark.slow
@pytest.mark.parametrize("target", list(COUNTS))
def test_fuzz_target(target, tmp_path):
    seed = 0 if os.environ.get("CI") else time.time_ns() % (1 << 32)
    findings = []
    for data in targets.inputs(target, COUNTS[target], seed):
        try:
            targets.check(target, data)
        except targets.Finding as f:
            findings.append(f)
            (tmp_path / f"{target}-{len(findings)}.bin").write_bytes(data)
            if len(findings) >= 5:
                break
    assert not findings, f"seed {seed}: " + "\n".join(str(f) for f in findings)


def test_protocol_seeds_hold_every_message_type():
    from hurraykv.net.codecs import CODECS

    seen = {t for seed in targets.seeds("protocol") for t, _ in targets.frames(seed)}
    assert set(CODECS) <= seen, sorted(set(CODECS) - seen)


def test_protocol_seeds_pass_the_target():
    for seed in targets.seeds("protocol"):
        targets.check("protocol", seed)


def test_the_tenant_target_takes_cryptographys_warnings_about_a_certificate_as_expected():
    """A mutated certificate (a serial <= 0, a country of 3 letters) makes cryptography
    warn as it parses it: expected of such inputs, so not a warning of the suite's."""
    import warnings

    from tests.support.tenant_certs import certificate, cn, replace_once

    serial_1000 = b"\x02\x02\x03\xe8"
    negative = replace_once(certificate(cn("alice"), serial=1000), serial_1000,
                            b"\x02\x02\x83\xe8")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        targets.check("tenant", negative)
    assert seen == [], [str(w.message) for w in seen]
