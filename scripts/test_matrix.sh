#!/usr/bin/env bash
# The transformers version matrix: the fast tests (-m "not slow") on each tested release, each in its own venv.
#
#   scripts/test_matrix.sh                       # the CI legs (LEGS below)
#   scripts/test_matrix.sh "transformers==5.6.2" "transformers==4.57.6 peft==0.17.0"   # any other legs
#
# A leg venv holds only the packages its spec changes (transformers, tokenizers, huggingface_hub, peft, ...);
# torch and everything else come from the base venv (BASE_VENV, default .venv, made by `make install`) through
# a .pth line, so torch is installed once. Leg venvs go under MATRIX_DIR (default .venvs/) and are reused
# while their spec is unchanged. MARK (default "not slow") selects the tests; MARK= runs the whole suite.
# Prints each leg's pytest summary line; exits non-zero if any leg fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${BASE_VENV:-.venv}
DIR=${MATRIX_DIR:-.venvs}
MARK=${MARK-not slow}

# the oldest supported 4.57 with the oldest supported peft; the first 5.x with the oldest peft that works on
# transformers 5; the GPU machine's 5.17 (a middle release) with the newest peft. The newest release is the base
# venv itself: .ci/run runs the full suite there.
LEGS=(
  "transformers==4.57.1 peft==0.17.0"
  "transformers==5.0.0 peft==0.18.0"
  "transformers==5.17.0"
)
[ $# -gt 0 ] && LEGS=("$@")

if [ ! -x "$BASE/bin/python" ]; then
  echo "no base venv at $BASE (run make install first, or set BASE_VENV)" >&2
  exit 2
fi
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

install_leg() {  # $1 venv dir, $2 spec
  local venv=$1 spec=$2
  if [ -f "$venv/.spec" ] && [ "$(cat "$venv/.spec")" = "$spec" ]; then return 0; fi
  rm -rf "$venv"
  "$BASE/bin/python" -m venv --without-pip "$venv" || return 1
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$base_site" > "$site/_hf_kvreuse_base.pth"   # appended after the leg's own site-packages
  # the base venv's pip installs into the leg: it sees torch & co. as installed and leaves them alone
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $spec 2>&1 \
      | grep -v "outside environment\|^WARNING: Location" || true
  "$venv/bin/python" -m pip check >/dev/null 2>&1 || "$venv/bin/python" -m pip check | grep -v "^hf-kvreuse" || true
  # shellcheck disable=SC2086
  "$venv/bin/python" - $spec <<'EOF' || return 1
import sys
from importlib.metadata import version
for req in sys.argv[1:]:
    name, _, want = req.partition("==")
    if want and version(name) != want:
        sys.exit(f"{name} {version(name)} installed, {want} wanted")
EOF
  echo "$spec" > "$venv/.spec"
}

status=0
results=()
for spec in "${LEGS[@]}"; do
  name=$(echo "$spec" | tr -s ' =' '-_' | tr -cd 'A-Za-z0-9._-')
  venv="$DIR/$name"
  t0=$(date +%s)
  if ! install_leg "$venv" "$spec" >"$DIR/$name.install.log" 2>&1; then
    cat "$DIR/$name.install.log"
    results+=("FAILED to install: $spec")
    status=1
    continue
  fi
  t1=$(date +%s)
  versions=$("$venv/bin/python" -c 'import torch, transformers, peft, tokenizers, huggingface_hub as hub, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, huggingface_hub {hub.__version__}, peft {peft.__version__}")')
  echo "== leg: $versions (install $((t1 - t0)) s)"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q ${MARK:+-m "$MARK"} -p no:cacheprovider \
      >"$DIR/$name.pytest.log" 2>&1
  rc=$?
  t2=$(date +%s)
  line=$(grep -E "^=* ?[0-9]+ (passed|failed|skipped|error)|no tests ran" "$DIR/$name.pytest.log" | tail -1)
  if [ $rc -ne 0 ]; then
    tail -n 60 "$DIR/$name.pytest.log"
    status=1
  fi
  results+=("[$versions] $line (rc $rc, tests $((t2 - t1)) s)")
done

echo "== matrix summary (${MARK:-all tests})"
printf '%s\n' "${results[@]}"
exit $status
