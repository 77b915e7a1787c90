"""`servetwin calibrate` and `servetwin validate` (torch is imported only when they run)."""
from __future__ import annotations


def add_calibration_args(sub) -> None:
    p = sub.add_parser("calibrate", help="profile the real engine as it serves and fit a cost-model profile")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), an HF dir or a .gguf")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", required=True, help="profile JSON to write (its steps go to OUT.steps.csv)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool size (default: what the engine sizes, recorded in the profile)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--requests-per-slot", type=float, default=2.0,
                   help="requests per unit of concurrency in each sweep group (more: longer, steadier)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core); recorded in the profile")
    p.add_argument("--refit", default=None, metavar="PROFILE.json",
                   help="no engine run: fit again the steps PROFILE.steps.csv holds (with this version's "
                        "fitting code) and write OUT")
    p.add_argument("--no-speed-probe", action="store_true",
                   help="do not time the reference workload between groups (calibration.probe): "
                        "the machine's drift then goes into the fit")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("validate", help="one workload through the real engine and the simulator: error table")
    p.add_argument("--profile", required=True, help="profile JSON (from servetwin calibrate)")
    p.add_argument("--workload", default="scenarios/validate-cpu.yaml", help="scenario YAML whose workload to replay")
    p.add_argument("--out", required=True, help="directory for validation.json and the CDF plots")
    p.add_argument("--model", default="default")
    p.add_argument("--device", default=None)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                   help="what-if: also validate the scenario with this field set to each value (any "
                        "scheduler or deployment field by its dotted path, as servetwin sweep takes them; "
                        "repeat for a grid), at the base setting's absolute rates")
    p.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.6, 0.9, 1.2],
                   help="fractions of the engine's measured capacity (default 0.3 0.6 0.9 and overload 1.2)")
    p.add_argument("--seeds", type=int, default=3, help="workload seeds per load (default 3)")
    p.add_argument("--duration-s", type=float, default=None,
                   help="arrival window of each run (s; default calibration.validate.DURATION_S, 40)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests per run at least (a light load's window grows to hold them; "
                        "default calibration.validate.MIN_REQUESTS)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the profile's, else torch's)")
    p.add_argument("--no-speed-probe", action="store_true",
                   help="do not scale the profile by the machine's speed measured before each run "
                        "(calibration.probe; only profiles that recorded a probe are scaled)")
    p.add_argument("--speed", choices=("in_situ", "probes", "in_situ_all"), default="in_situ",
                   help="the machine-speed model of the main error table (the others are reported beside it): "
                        "in_situ, the run's own decode-only steps at each moment, prefill chunks by the "
                        "compute probes (default); probes, the reference workload timed before and after "
                        "each run; in_situ_all, the run's own decode-only steps for the whole step")
    p.add_argument("--resimulate", action="store_true",
                   help="no engine run: redo the simulator's side and the report from the engine runs a "
                        "validation saved in OUT (engine-runs.pkl), with the same --workload and --set and "
                        "the profile they ran with (or a refit of it); their loads, seeds and probes are "
                        "the saved runs'")
    p.set_defaults(func=_validate)


def _calibrate(a) -> int:
    from calibration.calibrate import main
    return main(a)


def _validate(a) -> int:
    from calibration.validate import main
    return main(a)
