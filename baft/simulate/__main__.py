"""``python -m baft.simulate [--preset NAME | --scenario FILE] [--set key=value ...] [--json]``."""

import argparse
import json
import sys

from baft.accelerator import deepspeed_lines_to_stderr, quiet_detection

quiet_detection()  # before DeepSpeed is imported: the timeline reads its schedules
deepspeed_lines_to_stderr()

import baft.simulate  # noqa: E402
from baft.errors import BaftError  # noqa: E402
from baft.simulate.model import run  # noqa: E402
from baft.simulate.scenario import parse_overrides, preset_names  # noqa: E402
from baft.simulate.tables import render  # noqa: E402


def main(argv=None) -> int:
    """Simulate a preset or scenario file and print its tables (or ``--json``); 2 on a bad scenario."""
    parser = argparse.ArgumentParser(prog="baft simulate", description=baft.simulate.__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    parser.add_argument("--scenario", help="a scenario JSON file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = run(args.preset, args.scenario, parse_overrides(args.overrides))
    except BaftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
