#!/usr/bin/env bash
# The main job on the built-in demo model (a small DeepSeek-V3 trained on Python's
# documentation, docs/demo_model.md): start the server, send one chat request with curl,
# print the answer, stop the server (SIGTERM, as a service manager would). QUESTION=... asks
# another question.
set -euo pipefail
BIN="${BIN:-.venv/bin}"
PORT="${PORT:-8000}"
LOG="$(mktemp -t moeserve-demo.XXXXXX.log)"

"$BIN/moeserve" serve --port "$PORT" --served-model-name demo >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; echo "the server failed to start" >&2; exit 1; }
  sleep 0.2
done

QUESTION="${QUESTION:-What is a generator?}"
echo "POST /v1/chat/completions: $QUESTION"
BODY="$("$BIN/python" -c 'import json, sys
print(json.dumps({"model": "demo", "messages": [{"role": "user", "content": sys.argv[1]}],
                  "max_tokens": 64, "temperature": 0}))' "$QUESTION")"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" \
  -H "Content-Type: application/json" -d "$BODY" |
  "$BIN/python" -c 'import json, sys
r = json.load(sys.stdin)
print("answer:", r["choices"][0]["message"]["content"])
print("usage:", r["usage"]["prompt_tokens"], "prompt +", r["usage"]["completion_tokens"], "completion tokens")'
