#!/usr/bin/env bash
# Build the xfw CPU test device for Paddle (docs/testdevice.md) from the Paddle wheel's own headers
# and libraries: no download, no Paddle source. Output: .venv/paddle/lib/xfw-testdevice/libxfw_testcpu.so,
# the directory CUSTOM_DEVICE_ROOT names (xfw_paddle.testdevice sets it). Skips the build when the
# sources, this script, the wheel and the compiler are unchanged; each object is rebuilt only when
# its own inputs changed. Prints one line (also when there is no compiler: then nothing is built and
# exit 0); exit 1 with the compiler's words when compiling fails.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${XFW_TESTDEVICE_SRC:-adapters/paddle/testdevice}  # another source tree: benchmarks/testdevice_mutation.py
PY=${XFW_PADDLE_PYTHON:-.venv/paddle/bin/python}
OUT=${XFW_TESTDEVICE_DIR:-.venv/paddle/lib/xfw-testdevice}
CXX=${CXX:-g++}
LIB=$OUT/libxfw_testcpu.so

if [ ! -x "$PY" ]; then echo "build_testdevice: $PY not found (create .venv/paddle first)" >&2; exit 1; fi
if ! command -v "$CXX" >/dev/null 2>&1; then  # not an error: the test device is optional, its tests skip
  echo "testdevice: not built: no C++ compiler ($CXX); tests/contract/test_testdevice.py will skip"; exit 0
fi
PADDLE=$("$PY" -c "import importlib.util as u; s=u.find_spec('paddle'); print(s.submodule_search_locations[0] if s else '')")
if [ -z "$PADDLE" ] || [ ! -f "$PADDLE/include/paddle/phi/backends/device_ext.h" ]; then
  echo "build_testdevice: the Paddle wheel in $PY has no custom-device headers" >&2; exit 1
fi
WHEEL=$(ls -d "$PADDLE"/../paddlepaddle-*.dist-info 2>/dev/null | head -1)
FLAGS=(-std=c++17 -O2 -fPIC -fvisibility=hidden -Wno-attributes -DPADDLE_WITH_CUSTOM_DEVICE -DPADDLE_WITH_CUSTOM_KERNEL
       -I"$PADDLE/include" -I"$PADDLE/include/third_party" -I"$SRC")
SOURCES=$(ls "$SRC"/*.cc | sort)
HEADERS=$(ls "$SRC"/*.h | sort)

want=$( { cat $SOURCES $HEADERS "$0"; echo "$WHEEL ${FLAGS[*]}"; "$CXX" --version | head -1; } | sha256sum | cut -c1-16)
if [ -f "$LIB" ] && [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$want" ]; then
  echo "testdevice: $LIB is up to date"
  exit 0
fi

mkdir -p "$OUT/obj"
header_sum=$( { cat $HEADERS; echo "$WHEEL ${FLAGS[*]}"; } | sha256sum | cut -c1-12)
objects=()
todo=()
for src in $SOURCES; do
  obj="$OUT/obj/$(basename "$src" .cc)-$( { cat "$src"; echo "$header_sum"; } | sha256sum | cut -c1-12).o"
  objects+=("$obj")
  [ -f "$obj" ] || todo+=("$src:$obj")
done
start=$(date +%s)
log="$OUT/build.log"
: > "$log"
export CXX
FLAGSTR=$(printf '%q ' "${FLAGS[@]}")
if [ ${#todo[@]} -gt 0 ]; then
  if ! printf '%s\n' "${todo[@]}" | xargs -P "$(nproc 2>/dev/null || echo 2)" -I{} \
       bash -c "\"\$CXX\" $FLAGSTR -c \"\${0%%:*}\" -o \"\${0#*:}.tmp\" && mv \"\${0#*:}.tmp\" \"\${0#*:}\"" {} >>"$log" 2>&1; then
    cat "$log" >&2
    echo "build_testdevice: compiling failed (log above, kept in $log)" >&2
    exit 1
  fi
fi
if ! "$CXX" -shared -o "$LIB.tmp" "${objects[@]}" -L"$PADDLE/libs" -L"$PADDLE/base" -lphi_core -lcommon \
     -Wl,-rpath,"$PADDLE/libs" -Wl,--no-undefined -Wl,--allow-shlib-undefined >>"$log" 2>&1; then
  cat "$log" >&2
  echo "build_testdevice: linking failed (log above, kept in $log)" >&2
  exit 1
fi
mv "$LIB.tmp" "$LIB"
# objects of older sources are dead weight
for o in "$OUT"/obj/*.o; do case " ${objects[*]} " in *" $o "*) ;; *) rm -f "$o" ;; esac; done
echo "$want" > "$OUT/.stamp"
echo "testdevice: built $LIB in $(( $(date +%s) - start )) s (${#todo[@]} of ${#objects[@]} objects compiled)"
