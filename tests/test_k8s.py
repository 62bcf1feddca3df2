"""test_k8s.py: the Kubernetes manifests of etc/k8s. Each one validates against the schemas of
Kubernetes 1.30 and 1.37 in strict mode (unknown fields fail), as kubernetes-validate bundles
them (no network); deliberately broken copies are rejected, so the check cannot pass vacuously;
kustomization.yaml lists every manifest; the replicas' probes hit /health on the port
`caraserve serve` is told to serve, the Services and the router's --replica URLs reach it;
every flag of the replicas' command line and every option of the ConfigMap's caraserve.conf is
one `caraserve serve --help` lists, and the built binary reads that file without complaint;
the router's flags are checked against `caraserve router --help` once that command exists."""
import copy
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reflib  # noqa: E402

try:
    import yaml
    import kubernetes_validate.utils as kv
    from kubernetes_validate.version import __version__ as kv_version
except ImportError as e:
    print(f"FAIL: {e}: install the pinned test packages (pip install -r tests/requirements.txt)")
    sys.exit(1)

K8S_VERSIONS = ["1.30", "1.37"]  # the oldest Kubernetes these manifests claim, the newest bundled
K8S_DIR = os.path.join(reflib.SRCDIR, "etc", "k8s")
failures = []


def check(name, cond, detail=""):
    if cond:
        print(f"ok  {name}")
    else:
        failures.append(f"{name}{': ' + detail if detail else ''}")


def validate(doc):
    """None when doc validates against every version in strict mode, else why not"""
    for v in K8S_VERSIONS:
        try:
            kv.validate(doc, v, strict=True)
        except kv.ValidationError as e:
            return f"Kubernetes {v}: {'.'.join(map(str, e.path))}: {e.message}"
        except (kv.SchemaNotFoundError, kv.VersionNotSupportedError, kv.InvalidSchemaError) as e:
            return f"Kubernetes {v}: {e.message}"
    return None


def help_flags(*cmd):
    p = subprocess.run([reflib.CARASERVE, *cmd, "--help"], capture_output=True, text=True, timeout=60)
    # the options a line starts with, or a usage line's [--flag ...]
    return p, set(re.findall(r"(?:^\s*|\[)--([a-z][a-z0-9-]*)", p.stdout, re.M))


def flags_of(args):
    return [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]


def arg_value(args, flag):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def port_number(container, port):
    """a probe's or Service's port (a number or a containerPort's name) as a number"""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return named[0] if named else None


# ---- the files: kustomization.yaml lists every manifest, each one validates ----
files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(K8S_DIR, "*.yaml")))
manifests = [f for f in files if f != "kustomization.yaml"]
check("etc/k8s has manifests and a kustomization.yaml", manifests and "kustomization.yaml" in files, str(files))
with open(os.path.join(K8S_DIR, "kustomization.yaml")) as f:
    kust = yaml.safe_load(f)
check("kustomization.yaml: a Kustomization",
      kust.get("kind") == "Kustomization" and kust.get("apiVersion", "").startswith("kustomize.config.k8s.io/"))
listed = kust.get("resources", [])
check("kustomization.yaml lists every manifest of etc/k8s", sorted(listed) == manifests,
      f"listed {sorted(listed)}, on disk {manifests}")

docs = []
for name in manifests:
    with open(os.path.join(K8S_DIR, name)) as f:
        in_file = [d for d in yaml.safe_load_all(f) if d]
    check(f"{name}: one resource", len(in_file) == 1, f"{len(in_file)} documents")
    for d in in_file:
        why = validate(d)
        check(f"{name}: {d.get('kind')}/{d.get('metadata', {}).get('name')} validates (strict, Kubernetes "
              f"{' and '.join(K8S_VERSIONS)}, kubernetes-validate {kv_version})", why is None, why or "")
        docs.append(d)
if failures:  # what follows reads the manifests' fields: they must have the schemas' shape
    print("\n".join("FAIL " + f for f in failures))
    sys.exit(1)


def the(kind, component=None):
    found = [d for d in docs if d["kind"] == kind and (component is None or
             d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]
    if len(found) != 1:
        print(f"FAIL: expected one {kind} {component or ''} in etc/k8s, found {len(found)}")
        sys.exit(1)
    return found[0]


sts = the("StatefulSet")
cfgmap = the("ConfigMap")
router = the("Deployment", "router")
replica_svc = the("Service", "replica")
router_svc = the("Service", "router")

# ---- the validator can fail: broken copies of the (valid) StatefulSet are rejected, for that ----
broken = copy.deepcopy(sts)
c0 = broken["spec"]["template"]["spec"]["containers"][0]
c0["readinesProbe"] = c0.pop("readinessProbe", {"httpGet": {"path": "/health", "port": 8000}})
why = validate(broken) or ""
check("the validator rejects a misspelled field (readinesProbe)", "readinesProbe" in why, why or "accepted")
broken = copy.deepcopy(sts)
broken["spec"]["replicas"] = "three"
why = validate(broken) or ""
check("the validator rejects replicas: \"three\"", "spec.replicas" in why, why or "accepted")
broken = copy.deepcopy(sts)
del broken["spec"]["selector"]
why = validate(broken) or ""
check("the validator rejects a StatefulSet without its selector", "selector" in why, why or "accepted")

# ---- the replicas: probes on the served port, the Services reach it ----
pod = sts["spec"]["template"]["spec"]
ctr = [c for c in pod["containers"] if c["name"] == "caraserve"]
check("the StatefulSet has a container named caraserve", len(ctr) == 1)
ctr = ctr[0] if ctr else pod["containers"][0]
argv = ctr.get("command", []) + ctr.get("args", [])
serve_args = argv[argv.index("serve") + 1:] if "serve" in argv else []
check("the replicas run `caraserve serve`", argv[:2] == ["caraserve", "serve"], str(argv))
port = arg_value(serve_args, "--port")
serve_port = int(port) if port and port.isdigit() else None
check("the replicas serve on all addresses", arg_value(serve_args, "--host") in ("0.0.0.0", "::"), str(serve_args))
check("the container declares the port it serves on",
      serve_port in [p["containerPort"] for p in ctr.get("ports", [])], f"--port {port}, ports {ctr.get('ports')}")
for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
    get = ctr.get(probe, {}).get("httpGet", {})
    check(f"{probe} hits /health on the served port ({serve_port})",
          get.get("path") == "/health" and port_number(ctr, get.get("port")) == serve_port, str(ctr.get(probe)))
check("the headless Service is the StatefulSet's serviceName",
      replica_svc["spec"].get("clusterIP") == "None" and replica_svc["metadata"]["name"] == sts["spec"]["serviceName"])
pod_labels = sts["spec"]["template"]["metadata"]["labels"]
check("the headless Service selects the replicas", replica_svc["spec"]["selector"].items() <= pod_labels.items())
check("the headless Service's port is the served one",
      [port_number(ctr, p.get("targetPort", p["port"])) for p in replica_svc["spec"]["ports"]] == [serve_port])

# ---- the ConfigMap's file: mounted where --config reads it, drains within the grace period ----
conf_path = arg_value(serve_args, "--config")
mount = [m for m in ctr.get("volumeMounts", []) if conf_path and conf_path.startswith(m["mountPath"].rstrip("/") + "/")]
vol = [v for v in pod["volumes"] if mount and v["name"] == mount[0]["name"]]
conf_key = conf_path[len(mount[0]["mountPath"].rstrip("/")) + 1:] if mount else None
check(f"--config {conf_path} is a key of the ConfigMap mounted there",
      vol and vol[0].get("configMap", {}).get("name") == cfgmap["metadata"]["name"] and conf_key in cfgmap["data"],
      f"mounts {ctr.get('volumeMounts')}")
conf = cfgmap["data"].get(conf_key or "", "")
active = re.findall(r"^\s*([A-Za-z][\w-]*)\s*=", conf, re.M)
commented = re.findall(r"^\s*#\s*([a-z][a-z0-9-]*)\s*=\s*\S", conf, re.M)
timeout = re.findall(r"^\s*shutdown-timeout\s*=\s*([0-9.]+)\s*$", conf, re.M)
drain = float(timeout[-1]) if timeout else 30.0  # server/options.c's default
check(f"terminationGracePeriodSeconds covers the drain ({drain:g} s + 5 s for the aborts)",
      pod.get("terminationGracePeriodSeconds", 30) > drain + 5, str(pod.get("terminationGracePeriodSeconds")))
claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
pvcs = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
check("the models volume's claim is one of the manifests", claims and set(claims) <= set(pvcs), f"{claims} {pvcs}")

# ---- flags and options against the built binary ----
p, serve_flags = help_flags("serve")
check("caraserve serve --help exits 0 and lists --config", p.returncode == 0 and "config" in serve_flags, p.stderr)
unknown = [f for f in flags_of(serve_args) if f not in serve_flags]
check("every flag of the replicas' command line is in caraserve serve --help", not unknown, str(unknown))
check("the ConfigMap's caraserve.conf sets options", len(active) >= 3, conf)
unknown = [k for k in active + commented if k not in serve_flags or k in ("config", "help")]
check("every option of caraserve.conf (commented-out ones too) is in caraserve serve --help", not unknown,
      str(unknown))
# the binary itself reads the file: it then stops at the model (absent here), not at the file
tmp = tempfile.mkdtemp(prefix="cs_k8s_")
cf = os.path.join(tmp, "caraserve.conf")
with open(cf, "w") as f:
    f.write(conf)
p = subprocess.run([reflib.CARASERVE, "serve", "--config", cf, "--host", "127.0.0.1", "--port", "0",
                    "--model", os.path.join(tmp, "no-model")], capture_output=True, text=True, timeout=120)
check("caraserve serve reads the ConfigMap's file (it stops at the absent model or lora-root, not at the file)",
      p.returncode == 1 and cf + ":" not in p.stderr, f"exit {p.returncode}: {p.stderr[:400]}")
os.remove(cf)
os.rmdir(tmp)

# ---- the router: its --replica URLs name the replicas, its Service reaches its port ----
rpod = router["spec"]["template"]["spec"]
rctr = rpod["containers"][0]
rargv = rctr.get("command", []) + rctr.get("args", [])
router_args = rargv[rargv.index("router") + 1:] if "router" in rargv else []
check("the router runs `caraserve router`", rargv[:2] == ["caraserve", "router"], str(rargv))
want = [f"http://{sts['metadata']['name']}-{i}.{replica_svc['metadata']['name']}:{serve_port}"
        for i in range(sts["spec"]["replicas"])]
got = [router_args[i + 1] for i, a in enumerate(router_args[:-1]) if a == "--replica"]
check(f"the router has one --replica per replica ({sts['spec']['replicas']})", got == want, f"{got} != {want}")
rport = arg_value(router_args, "--port")
rport = int(rport) if rport and rport.isdigit() else None
get = rctr.get("readinessProbe", {}).get("httpGet", {})
check(f"the router's readinessProbe hits /health on its port ({rport})",
      get.get("path") == "/health" and port_number(rctr, get.get("port")) == rport, str(rctr.get("readinessProbe")))
router_labels = router["spec"]["template"]["metadata"]["labels"]
check("the router's Service: port 80 to the router's port, selecting the routers",
      [(p["port"], port_number(rctr, p.get("targetPort", p["port"]))) for p in router_svc["spec"]["ports"]]
      == [(80, rport)] and router_svc["spec"]["selector"].items() <= router_labels.items())
p, router_flags = help_flags("router")
if p.returncode != 0:
    why = re.findall(r"caraserve: [^\n]*", p.stderr)
    print(f"skip the router's flags: `caraserve router --help` exits {p.returncode}"
          f"{' (' + why[0] + ')' if why else ''}: this build has no router yet")
else:
    unknown = [f for f in flags_of(router_args) if f not in router_flags]
    check("every flag of the router's command line is in caraserve router --help", not unknown, str(unknown))

if failures:
    print("\n".join("FAIL " + f for f in failures))
    sys.exit(1)
print("PASS")
