#!/usr/bin/env bash
# Reproduces benchmarks/results/frontdoor-session.txt: bash benchmarks/frontdoor_session.sh (port 8011 free).
# A session against a local cluster (security on by default): curl and the openai client, metrics.
set -u
odmoe-launch role=local serve=true server.http_port=8011 2> /tmp/serve.log &
LAUNCH=$!
until grep -q "OpenAI-compatible API" /tmp/serve.log; do sleep 1; done
grep "odmoe:" /tmp/serve.log
KEYS=$(grep -o -- "--key-dir [^ ]*" /tmp/serve.log | cut -d' ' -f2)
AUTH=(--cacert $KEYS/tls/cert.pem -H "Authorization: Bearer $(cat $KEYS/token)")
U=https://localhost:8011
echo '$ curl -s $U/v1/models   (no token)'; curl -s --cacert $KEYS/tls/cert.pem $U/v1/models; echo
echo '$ curl -s "${AUTH[@]}" $U/v1/models'; curl -s "${AUTH[@]}" $U/v1/models; echo
MODEL=$(curl -s "${AUTH[@]}" $U/v1/models | python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo '$ curl -s "${AUTH[@]}" $U/v1/completions -d {"prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0}'
curl -s "${AUTH[@]}" $U/v1/completions -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 40, \"temperature\": 0}"; echo
echo '$ curl -sN ... "stream": true, "stop": ["return"], "stream_options": {"include_usage": true}'
curl -sN "${AUTH[@]}" $U/v1/completions -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 40, \"temperature\": 0, \"stop\": [\"return\"], \"stream\": true, \"stream_options\": {\"include_usage\": true}}" | cut -c1-220; echo
echo '$ curl -s ... {"n": 2}'
curl -s "${AUTH[@]}" $U/v1/completions -H 'content-type: application/json' -d "{\"model\": \"$MODEL\", \"prompt\": \"x\", \"n\": 2}"; echo
echo '$ python: openai client, seeded chat stream vs transformers generate'
python - "$MODEL" "$KEYS" <<'PY'
import sys, ssl, glob, os, httpx, openai, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
name, keys = sys.argv[1:]
tls = httpx.Client(verify=ssl.create_default_context(cafile=f"{keys}/tls/cert.pem"))
api = openai.OpenAI(base_url="https://127.0.0.1:8011/v1", api_key=open(f"{keys}/token").read().strip(), http_client=tls)
messages = [{"role": "user", "content": "Write a loop"}]
text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
    model=name, messages=messages, max_tokens=30, temperature=0.8, top_p=0.95, seed=42, stream=True))
print("odmoe :", repr(text))
path = [p for p in glob.glob(os.path.expanduser("~/.cache/odmoe/models/*")) if os.path.basename(p) == name][0]
tok = AutoTokenizer.from_pretrained(path); model = AutoModelForCausalLM.from_pretrained(path)
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
torch.manual_seed(42)
out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=30)
ref = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print("hf    :", repr(ref)); print("identical:", text == ref)
PY
echo '$ odmoe-chat --url $U --key-dir $KEYS --completion --max-tokens 24 "import os"'
odmoe-chat --url $U --key-dir $KEYS --completion --max-tokens 24 "import os"
echo '$ curl -s "${AUTH[@]}" $U/metrics | (selected series)'
curl -s "${AUTH[@]}" $U/metrics | grep -v "^#" | grep -E '^odmoe:(time_to_first|inter_token)[^ ]*(count|sum)|_total|num_requests|recall'
kill -INT $LAUNCH; wait $LAUNCH; echo "launch exit $?"
