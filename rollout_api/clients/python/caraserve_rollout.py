"""caraserve_rollout.py: a trainer-side client for caraserve's rollout API, standard library only.

    from caraserve_rollout import Client
    c = Client("http://127.0.0.1:8000", api_key=None)
    c.push_adapter("policy", 1, open("adapter_model.safetensors", "rb").read(), lora_alpha=16)
    out = c.rollout([{"input_ids": ids, "n": 8, "seed": 1}], adapter="policy",
                    sampling={"max_tokens": 64, "temperature": 1.0, "logprobs": {"mode": "processed"}})
    for g in out["groups"]:
        for s in g["samples"]:
            s["output_ids"], s["logprobs"], s["adapter_version"]
"""
import http.client
import json
import urllib.parse


class RolloutError(Exception):
    def __init__(self, status, body):
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {msg}")
        self.status = status
        self.body = body


class Client:
    def __init__(self, base_url, api_key=None, timeout=3600):
        u = urllib.parse.urlparse(base_url)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _call(self, method, path, body=None, raw=None, content_type="application/json"):
        c = self._conn()
        h = dict(self.headers)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            h["Content-Type"] = content_type
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        txt = r.read()
        c.close()
        try:
            out = json.loads(txt)
        except ValueError:
            out = txt.decode("utf-8", "replace")
        if r.status != 200:
            raise RolloutError(r.status, out)
        return out

    @staticmethod
    def _body(groups, adapter, sampling, batch_id, target_groups, stream):
        b = {"groups": groups, "stream": stream}
        if adapter is not None:
            b["adapter"] = adapter
        if sampling is not None:
            b["sampling"] = sampling
        if batch_id is not None:
            b["batch_id"] = batch_id
        if target_groups is not None:
            b["completion"] = {"target_groups": target_groups, "on_target": "abort_return_partial"}
        return b

    def rollout(self, groups, adapter=None, sampling=None, batch_id=None, target_groups=None):
        """One POST /v1/rollout: {"groups": [...], "summary": {...}}."""
        return self._call("POST", "/v1/rollout", self._body(groups, adapter, sampling, batch_id, target_groups, False))

    def stream_rollout(self, groups, adapter=None, sampling=None, batch_id=None, target_groups=None):
        """Yields each group as it finishes, then {"summary": {...}}."""
        c = self._conn()
        h = dict(self.headers, **{"Content-Type": "application/json"})
        c.request("POST", "/v1/rollout", body=json.dumps(self._body(groups, adapter, sampling, batch_id,
                                                                     target_groups, True)).encode(), headers=h)
        r = c.getresponse()
        if r.status != 200:
            raise RolloutError(r.status, json.loads(r.read() or b"{}"))
        try:
            for line in r:
                line = line.strip()
                if line:
                    yield json.loads(line)
        finally:
            c.close()

    def push_adapter(self, name, version, weights=None, path=None, lora_alpha=None, r=None, target_modules=None,
                     apply="next_request", activate=True, keep_versions=None):
        """PUT /v1/adapters/NAME/versions/VERSION with the raw adapter_model.safetensors bytes
        (r and target_modules are read from the tensors unless given) or a directory path under the
        server's --lora-root.

        activate=False stages the version (requests pin it with adapter={"name", "version"};
        activate_adapter() makes it active later). apply: next_request (running requests finish on
        the version they started with), abort_inflight (they end now, partial output returned) or
        pause_keep (they go on with the new weights from the next token, keeping their KV cache;
        their version_spans show where). keep_versions=N keeps the N newest versions pinnable.
        Returns {name, version, active_version, bytes, load_ms, aborted_requests, moved_requests,
        kept_versions}."""
        q = {"apply": apply}
        if not activate:
            q["activate"] = "false"
        if keep_versions is not None:
            q["keep_versions"] = str(int(keep_versions))
        if lora_alpha is not None:
            q["lora_alpha"] = str(lora_alpha)
        if r is not None:
            q["r"] = str(r)
        if target_modules:
            q["target_modules"] = ",".join(target_modules)
        url = f"/v1/adapters/{urllib.parse.quote(name)}/versions/{int(version)}?{urllib.parse.urlencode(q)}"
        if path is not None:
            return self._call("PUT", url, {"path": path})
        return self._call("PUT", url, raw=bytes(weights), content_type="application/octet-stream")

    def activate_adapter(self, name, version, apply="next_request"):
        """Make kept version VERSION of NAME the active one (an empty PUT)."""
        url = f"/v1/adapters/{urllib.parse.quote(name)}/versions/{int(version)}?apply={urllib.parse.quote(apply)}"
        return self._call("PUT", url, raw=b"", content_type="application/octet-stream")

    def delete_adapter_version(self, name, version):
        return self._call("DELETE", f"/v1/adapters/{urllib.parse.quote(name)}/versions/{int(version)}")

    def adapters(self):
        return self._call("GET", "/v1/adapters")

    def update_weights(self, path, weight_version=None, apply="next_request", load="auto", keep_versions=None,
                       flush_cache=False):
        """POST /v1/weights: the base weights from the Hugging Face directory PATH (under the
        server's --lora-root), checked against the served model first. load: beside (while
        serving), in_place (the engine stops for the load) or auto. apply as for adapters.
        Returns {version, weight_version, path, load, bytes, load_ms, pause_ms, moved_requests,
        aborted_requests}."""
        b = {"path": path, "apply": apply, "load": load, "flush_cache": flush_cache}
        if weight_version is not None:
            b["weight_version"] = str(weight_version)
        if keep_versions is not None:
            b["keep_versions"] = int(keep_versions)
        return self._call("POST", "/v1/weights", b)

    def weights(self):
        """GET /v1/weights: the base versions held, the active one first."""
        return self._call("GET", "/v1/weights")["versions"]

    def abort(self, batch_id=None, group_ids=None, all=False):
        b = {"all": True} if all else {"batch_id": batch_id} if batch_id is not None else {"group_ids": list(group_ids)}
        return self._call("POST", "/v1/rollout/abort", b)
