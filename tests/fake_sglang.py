"""A stand-in for `python -m sglang.launch_server` in the launcher's tests
(tests/test_faults_auth.py): it is started with the launcher's real argument
list, reads the private options file (`--config`) as SGLang does, prints its
arguments, API key included, as SGLang's start-up log does, confirms the
capture hook as SGLang does, and serves /health only to a request carrying
that key. (SGLang serves /health without one; this is stricter, so a health
check that leaves the key out fails here.) FAKE_SGLANG_EXIT=N makes it exit
with N after printing, as a server that fails to start."""
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> None:
    args = dict(zip(argv, argv[1:]))
    with open(args["--config"]) as f:
        options = json.load(f)
    key = options["api-key"]
    hooks = json.loads(options.get("forward-hooks", "[]"))
    settings = {"model_path": args["--model-path"], "tp_size": int(args["--tp-size"]), "api_key": key,
                "forward_hooks": hooks}
    print(f"[2026-12-01 10:17:31] server_args={settings!r}", flush=True)  # as SGLang 0.5.23 logs it
    if os.environ.get("FAKE_SGLANG_EXIT"):
        sys.exit(int(os.environ["FAKE_SGLANG_EXIT"]))
    for hook in hooks:
        print(f"Registered forward hook '{hook['name']}' on {hook['target_modules']}", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and self.headers.get("Authorization") == f"Bearer {key}"
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
