# Sourced by benchmarks/gpu_tables.sh and benchmarks/gpu_check.sh for their `--wheels DIR`: a GPU machine without
# internet whose python3 already holds a CUDA build of PyTorch gets the suite's other packages from the wheels that
# scripts/wheelhouse.py downloaded elsewhere (docs/gpu.md#a-gpu-machine-without-internet).

# use_wheels DIR PYTHON: install DIR's wheels into a temporary folder of this machine (no index, no dependency
# resolution: the wheelhouse holds the closure) and put it first on PYTHONPATH, then this checkout (the suite's own
# packages, which a virtualenv holds as an editable install and the wheels do not: `python benchmarks/x.py` would not
# find them), its `mlflow` command in MLFLOW (scripts/mlflow_server.sh). Run from the checkout's root, as the
# benchmarks' scripts do. Exit status 2 with one line when DIR holds no wheel; 1 when pip fails.
use_wheels() {
  local dir="$1" py="$2" site
  if ! compgen -G "$dir/*.whl" >/dev/null; then
    echo "$(basename "$0"): --wheels $dir holds no .whl file (make them with scripts/wheelhouse.py)" >&2
    return 2
  fi
  site="${TMPDIR:-/tmp}/flowlm-site-$(id -u)"
  if ! "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "$dir"/*.whl; then
    echo "$(basename "$0"): installing the wheels of $dir into $site failed (above)" >&2
    return 1
  fi
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if [ -x "$site/bin/mlflow" ]; then export MLFLOW="$site/bin/mlflow"; fi
  echo "$(basename "$0"): $(compgen -G "$dir/*.whl" | wc -l) wheels of $dir installed into $site (PYTHONPATH)"
}
