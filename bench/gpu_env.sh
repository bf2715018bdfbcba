# Source this on a lent GPU machine (no network, so no editable install): it exposes tritonspec and
# its vendor backends on PYTHONPATH with the entry points pip would register from setup.py.
#   source bench/gpu_env.sh && python bench/bench_kernels.py
_ts_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_ts_site=/tmp/tritonspec-site
rm -rf "$_ts_site" && mkdir -p "$_ts_site/tritonspec-0.1.0.dist-info"
ln -s "$_ts_root/python/tritonspec" "$_ts_site/tritonspec"
ln -s "$_ts_root/third_party" "$_ts_site/tritonspec_backends"
printf 'Metadata-Version: 2.1\nName: tritonspec\nVersion: 0.1.0\n' > "$_ts_site/tritonspec-0.1.0.dist-info/METADATA"
python3 - "$_ts_root/setup.py" > "$_ts_site/tritonspec-0.1.0.dist-info/entry_points.txt" <<'PY'
import runpy, sys, types
setup_kwargs = {}  # run setup.py with a stand-in setuptools that only records its arguments
sys.modules["setuptools"] = types.SimpleNamespace(setup=lambda **kw: setup_kwargs.update(kw),
                                                  find_packages=lambda *a, **k: [])
runpy.run_path(sys.argv[1])
for group, entries in setup_kwargs["entry_points"].items():
    print(f"[{group}]")
    print("\n".join(entries) + "\n")
PY
export PYTHONPATH="$_ts_site${PYTHONPATH:+:$PYTHONPATH}"
