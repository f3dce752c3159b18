#!/usr/bin/env bash
# Does vLLM's speculators library read our EAGLE-3 export as we mean it? Our side writes a
# random EAGLE head of a tiny target in the speculators layout and drafts one sequence; a
# separate venv (speculators pins another transformers than ours) loads that folder with
# speculators' own Eagle3DraftModel and drafts the same sequence. Prints "equal: True" when
# every greedy draft token agrees. With a bundle (export.method=eagle on the embedded target),
# its head is checked instead, on a chat prompt.
# Usage: tools/speculators_check/run.sh [work dir] [bundle]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${1:-/tmp/specdraft-speculators-check}
venv=$work/venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0 "transformers>=5.0,<=5.19.0" safetensors pydantic pydantic-settings \
    loguru numpy rich typer httpx click tqdm psutil protobuf openai aiohttp "datasets<=5.1.0"
  "$venv/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
fi
rm -rf "$work/out"
"$root/.venv/bin/python" "$here/ours.py" "$work/out" ${2:+"$(cd "$2" && pwd)"}
"$venv/bin/python" "$here/theirs.py" "$work/out"
