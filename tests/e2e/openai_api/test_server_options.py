"""engine-serve options users bring from `vllm serve`: --chat-template, --tokenizer and HTTPS
(--ssl-keyfile / --ssl-certfile), with the official openai client; bad values stop the server at start."""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, Server

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_https_with_chat_template_and_tokenizer_folder(tiny_serving_model, tls_files, tmp_path):
    from transformers import AutoTokenizer
    tokenizer_dir = str(tmp_path / "tokenizer")
    AutoTokenizer.from_pretrained(tiny_serving_model).save_pretrained(tokenizer_dir)
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = Server(*SMALL_KV, "--tokenizer", tokenizer_dir, "--chat-template", str(template),
                 model=tiny_serving_model, tls=tls_files, max_model_len=512)
    try:
        messages = [{"role": "user", "content": "hi there"}]
        expected = AutoTokenizer.from_pretrained(tokenizer_dir).encode("[user] hi there\n[assistant]",
                                                                      add_special_tokens=False)
        tokens = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}, headers=srv.auth,
                            verify=srv.verify, timeout=30).json()["tokens"]
        assert tokens == expected
        with httpx.Client(verify=srv.verify, timeout=120) as http:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, http_client=http, max_retries=0)
            model = client.models.list().data[0].id
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        assert chat.usage.prompt_tokens == len(expected) and chat.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):            # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):         # a client that does not trust the certificate
            httpx.get(f"{srv.url}/health", timeout=10)
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "{% if %}"], "chat template does not parse"),
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor a Jinja template"),
    (["--tokenizer", "/no/such/tokenizer"], "tokenizer must be a local tokenizer folder"),
    (["--ssl-certfile", "/etc/hostname"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-certfile", "/no/cert.pem", "--ssl-keyfile", "/no/key.pem"], "is not a file"),
])
def test_bad_option_values_stop_the_server_at_start(tiny_serving_model, flags, message):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.cli", tiny_serving_model, "--port", "1",
                           *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
