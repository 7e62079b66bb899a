"""Tests of step 6's pure parts (_latency.py): no GPU, no PyTorch.

Run: python3 examples/gpu-check/test_latency.py (examples/tests/gpu_check.rs runs it).
"""
import json
import math
import os
import tempfile
import unittest

import _latency as L


class FakeClock:
    """A clock that moves only when slept on or when a request runs."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        assert s > 0, "slept for nothing or less"
        self.t += s


class Serve(unittest.TestCase):
    def test_a_request_faster_than_the_gaps_has_its_own_duration_as_latency(self):
        c = FakeClock()

        def request():
            c.t += 0.002

        lat = L.serve(request, 10.0, 50.0, seed=3, clock=c, sleep=c.sleep)
        # Poisson arrivals at a mean gap of 50 ms over 10 s: about 200.
        self.assertTrue(150 < len(lat) < 250, len(lat))
        # A request that found the tenant idle waited for nothing: its latency is its 2 ms.
        self.assertAlmostEqual(min(lat), 0.002)
        self.assertTrue(all(x >= 0.002 - 1e-9 for x in lat))

    def test_a_request_arriving_while_one_runs_counts_its_wait(self):
        c = FakeClock()

        def request():
            c.t += 0.100  # 100 ms per request, arrivals every 10 ms on average: a backlog

        lat = L.serve(request, 2.0, 10.0, seed=1, clock=c, sleep=c.sleep)
        # Open loop: the queue grows, so later requests wait far longer than one request.
        self.assertGreater(lat[-1], 1.0)
        self.assertEqual(lat, sorted(lat))

    def test_no_arrival_inside_the_window_means_no_request(self):
        c = FakeClock()
        self.assertEqual(L.serve(lambda: None, 1e-9, 1000.0, clock=c, sleep=c.sleep), [])


class Quantiles(unittest.TestCase):
    def test_the_ceil_quantile_of_latency_tier(self):
        v = list(range(1, 101))
        self.assertEqual(L.quantile(v, 0.5), 50)
        self.assertEqual(L.quantile(v, 0.99), 99)
        self.assertEqual(L.quantile(v, 0.999), 100)
        self.assertEqual(L.quantile([7], 0.5), 7)
        self.assertEqual(L.quantile(v, 0.0), 1)
        self.assertTrue(math.isnan(L.quantile([], 0.5)))

    def test_summary_in_ms(self):
        s = L.summary([0.003, 0.001, 0.002])
        self.assertEqual((s["requests"], s["p50_ms"], s["p99_ms"], s["mean_ms"]), (3, 2.0, 3.0, 2.0))


class Args(unittest.TestCase):
    def test_defaults_and_values(self):
        a = L.parse(["serve", "20"])
        self.assertEqual((a.role, a.seconds, a.gap_ms, a.kernels, a.size, a.delay),
                         ("serve", 20.0, 10.0, 4, 0, 1.0))
        a = L.parse(["train", "5", "--size", "4096"])
        self.assertEqual((a.role, a.size), ("train", 4096))

    def test_bad_arguments_exit_2(self):
        for argv in (["idle", "1"], ["serve"], ["serve", "0"], ["serve", "1", "--gap-ms", "0"],
                     ["serve", "1", "--kernels", "0"], ["serve", "x"]):
            with self.assertRaises(SystemExit) as e:
                with open(os.devnull, "w") as null, _stderr(null):
                    L.parse(argv)
            self.assertEqual(e.exception.code, 2, argv)


class _stderr:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        import sys
        self.old, sys.stderr = sys.stderr, self.f

    def __exit__(self, *_):
        import sys
        sys.stderr = self.old


class Rows(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def file(self, name, obj=None, err=None):
        p = os.path.join(self.dir.name, name + ".json")
        with open(p, "w") as f:
            if obj is not None:
                f.write("warming up\n" + json.dumps(obj) + "\n")
        if err is not None:
            with open(p[:-5] + ".err", "w") as f:
                f.write(err + "\n\n")
        return p

    def serve(self, name, p50, p99, n=100):
        return self.file(name, {"requests": n, "p50_ms": p50, "p99_ms": p99})

    def train(self, name, per_s, kernel_ms=2.0):
        return self.file(name, {"per_s": per_s, "kernel_ms": kernel_ms})

    def test_the_ratios_to_alone_and_the_verdicts(self):
        r = L.rows({
            "alone": [self.serve("alone", 2.0, 4.0)],
            "plain": [self.serve("p", 10.0, 40.0), self.train("p1", 10), self.train("p2", 10)],
            "shares": [self.serve("s", 6.0, 20.0), self.train("s1", 9), self.train("s2", 9)],
            "tier": [self.serve("t", 2.8, 4.4), self.train("t1", 9), self.train("t2", 8)],
        })
        by = {m: (res, tgt, met) for m, res, tgt, met in r}
        self.assertEqual(by["latency tenant alone (no Tessera)"],
                         ("p50 2.00 ms, p99 4.00 ms, 100 requests", "-", "-"))
        res, tgt, met = by["beside 2 best-effort: time-slicing (no Tessera)"]
        self.assertIn("p50 10.00 ms (5.00x), p99 40.00 ms (10.00x alone)", res)
        self.assertEqual((tgt, met), ("-", "-"))
        res, tgt, met = by["beside 2 best-effort: Tessera, latency tier"]
        self.assertIn("(1.40x)", res)
        self.assertIn("(1.10x alone)", res)
        self.assertIn("a best-effort kernel ≈ 2.00 ms", res)
        self.assertEqual((tgt, met), ("p50 ≤ 1.5x, p99 ≤ 1.2x alone", "yes"))
        self.assertEqual(by["best-effort work under the tier / under time-slicing"],
                         ("0.85 (17 vs 20 per s)", "≥ 0.85", "yes"))

    def test_a_tier_over_its_p99_target_is_not_met(self):
        r = L.rows({"alone": [self.serve("a", 2.0, 4.0)],
                    "plain": [self.serve("p", 9.0, 9.0), self.train("p1", 10)],
                    "tier": [self.serve("t", 2.0, 5.0), self.train("t1", 5)]})
        by = {m: met for m, _, _, met in r}
        self.assertEqual(by["beside 1 best-effort: Tessera, latency tier"], "NO")
        self.assertEqual(by["best-effort work under the tier / under time-slicing"], "NO")

    def test_a_tenant_without_a_result_is_a_failed_row_with_its_last_error(self):
        r = L.rows({"alone": [self.serve("a", 2.0, 4.0)],
                    "tier": [self.serve("t", 2.0, 4.0),
                             self.file("l6_tier_be1", None, err="torch.OutOfMemoryError: x")]})
        m, res, _, met = r[-1]
        self.assertEqual(met, "NO")
        self.assertTrue(res.startswith("failed: no result from l6_tier_be1 (torch.OutOfMemoryError"),
                        res)
        r = L.rows({"alone": [self.file("a", None)]})
        self.assertEqual(len(r), 1)
        self.assertTrue(r[0][1].startswith("failed"), r)


if __name__ == "__main__":
    unittest.main()
