#!/usr/bin/env python3
"""How long a thin volume takes to get its copies (issue 57): `volume mirror NAME add` on a thin
volume, timed until both new copies are synced and have taken over, beside the same on a thick
volume of 1 GiB (the time to copy 1 GiB through the same path at the same `resync_rate`).

One spoold (release build, keeper, journal on tmpfs), a pool of four files on tmpfs with 4 MiB
chunks, the default `resync_rate` (64 MiB/s). Cases: an empty 1 GiB thin volume; a 1 TiB thin
volume with its first 1 GiB written; a 1 GiB thick volume written whole. The copy asks the
source's map what it never wrote and neither reads it nor counts it against the rate; before,
every hole was read and paced (1 GiB about 16 s, 1 TiB about 4.5 hours).

    scripts/bench-thin-rebuild.py            # the three cases
    scripts/bench-thin-rebuild.py --quick    # the empty 1 GiB case only (thin-rebuild-quick.json)
Results: docs/benchmarks/thin-rebuild.json (docs/benchmarks/thin-rebuild.md discusses them).
"""

import shutil
import time

import benchlib as b
from benchlib import Spoold, dev, log, vol

GIB = 1 << 30


def copies_done(d, name):
    """The volume's mirror once every copy is synced and current (None before)."""
    v = d.call("volume_show", id=name)
    m = v.get("mirror")
    if not m or m["copies"] < 2:
        return None
    legs = m["legs"]
    if all(l["synced"] and l["state"] == "current" for l in legs) and len(legs) == m["copies"]:
        return m
    return None


def add_copies(d, name, timeout):
    t0 = time.monotonic()
    d.call("volume_mirror", id=name, action="add")
    while True:
        m = copies_done(d, name)
        if m:
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{name}: copies not done after {timeout} s: {d.call('volume_show', id=name)}")
        time.sleep(0.05)


def main():
    a = b.args(__doc__)
    shm = b.workdir("spool-thin-rebuild-")
    devices = [dev(f"{shm}/d{i}.img", "6G") for i in range(4)]
    cases = [("empty", "1G", True, 0)]
    if not a.quick:
        cases += [("big", "1T", True, GIB), ("thick", "1G", False, GIB)]
    vols = [vol(n, size, **({"thin": True} if thin else {})) for n, size, thin, _ in cases]
    rows = []
    with Spoold(shm, devices, vols, sections={"pool": {"min_extent": "4M"}}) as d:
        for name, size, thin, written in cases:
            if written:
                b.fill(d.socks[name], size=written, bs=4 << 20, qd=1)
            secs, m = add_copies(d, name, timeout=3600)
            row = dict(volume=name, size=size, thin=thin, written=written, seconds=round(secs, 2),
                       unwritten_bytes=m.get("unwritten_bytes", 0), zeroed_bytes=m.get("zeroed_bytes", 0),
                       regions_copied=m.get("regions_copied", 0))
            log(f"{name}: {size} {'thin' if thin else 'thick'}, {written >> 20} MiB written: copies in {secs:.2f} s "
                f"({row['unwritten_bytes'] >> 20} MiB never written on either side: neither read nor written)")
            rows.append(row)
    shutil.rmtree(shm)
    b.save("thin-rebuild", {"resync_rate": 64 << 20, "cases": rows}, quick=a.quick)


if __name__ == "__main__":
    main()
