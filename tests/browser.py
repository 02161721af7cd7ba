"""A real JupyterLab in a real headless Chromium, for tests that drive the UI as a student would.

`JupyterLab` serves a folder from a server on 127.0.0.1 (a token, a free port, settings and
runtime files in a temporary home, and a `python3` kernel that is this interpreter, so the
notebook sees the project's venv). `Chromium` starts Debian's Chromium through its chromedriver
with the flags a closed network and a root container need. Both always end their whole process
tree: a test that fails half-way must not leave a server, a kernel or a browser running on a
shared machine. `NotebookPage` drives JupyterLab's own menus and reads what it rendered.

Behind a proxy, callers put 127.0.0.1 and localhost in no_proxy (urllib and selenium honour it).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import psutil

from processes import alive

CHROMIUM_NAMES = ("chromium", "chromium-browser")  # matched to chromedriver by the distribution

# No GPU, no shared memory worth the name in a container, and no network but localhost: every
# background fetch (updates, sync, field trials) would only wait on a refused connection.
# --no-sandbox: the sandbox needs user namespaces that root and most containers do not have;
# the page is our own server on 127.0.0.1, reached directly whatever proxy the machine sets.
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-extensions", "--disable-crash-reporter", "--no-proxy-server",
    "--window-size=1400,1000",
)

KERNEL_NAME = "Python 3 (distlab)"  # the display name of the kernelspec JupyterLab gets, shown in its toolbar

# JupyterLab settings for a test: all cells attached to the DOM (the default windowing detaches or
# skips cells out of view, which a DOM query would miss), no news pop-up over the notebook, and no
# autosave: the file changes only when the test saves it.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def find_chromium() -> tuple[str | None, str | None]:
    """Paths of a Chromium binary and its chromedriver, or None for what is missing."""
    browser = next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)
    return browser, shutil.which("chromedriver")


def stop_processes(procs: list[psutil.Process], grace: float = 10.0) -> list[psutil.Process]:
    """Terminate `procs`, then kill those that ignore it; returns any still alive after both.

    A zombie counts as ended: it runs nothing, and one whose parent already exited waits for an
    init that reaps it (a container's PID 1 may never do so, and psutil would wait for it in vain).
    """
    running = procs
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        for proc in running:
            try:
                stop(proc)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            _, running = psutil.wait_procs(running, timeout=0.2)  # reaps those that are our children
            running = [proc for proc in running if alive(proc)]
    return running


def _end_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, even by SIGKILL (Linux).

    Teardown ends everything on a normal or failed exit; this covers a test run that is killed
    outright (a CI job's time limit). SIGKILL because a JupyterLab told to stop can hang in its
    shutdown; its kernels exit by themselves when their server is gone (ipykernel polls its parent).
    """
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def process_tree(root: psutil.Process) -> list[psutil.Process]:
    """`root` and its descendants, found while they are still its descendants."""
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class JupyterLab:
    """A JupyterLab server for one test, in a temporary home; use it as a context manager.

    Everything the server and the kernel would write outside `root_dir` (config, runtime files,
    workspaces, settings, IPython history) goes under `home`, so a user's own Jupyter set-up
    neither leaks in nor gets touched.
    """

    def __init__(self, root_dir: Path, home: Path, start_timeout: float = 180.0):
        self.root_dir, self.home, self.start_timeout = Path(root_dir), Path(home), start_timeout
        self._dirs = {name: self.home / name for name in ("config", "data", "runtime", "ipython", "settings",
                                                          "workspaces")}
        self.token = secrets.token_hex(16)
        self.log_path = self.home / "jupyterlab.log"
        self.proc: psutil.Popen | None = None
        self.port: int | None = None
        self.left_behind: list[psutil.Process] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _prepare_home(self) -> dict[str, str]:
        """Create the temporary home and return the server's environment pointing into it."""
        dirs = self._dirs
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        # The kernel is the interpreter running the tests (the project's .venv under `make test`),
        # whatever kernelspec a user or another environment installed under the name python3.
        kernel_dir = dirs["data"] / "kernels" / "python3"
        kernel_dir.mkdir(parents=True, exist_ok=True)
        (kernel_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": KERNEL_NAME, "language": "python"}))
        for name, values in LAB_SETTINGS.items():
            path = dirs["settings"] / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
                   JUPYTER_PATH=str(dirs["data"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
                   IPYTHONDIR=str(dirs["ipython"]))
        env.pop("JUPYTER_TOKEN", None)
        env.pop("JUPYTER_PORT", None)
        # What a student's JupyterLab sees: no sign of a test run or CI, so the kernel shows what a person
        # sees (distlab's rank output as HTML, live progress bars: distlab.runtime.output.audience).
        for name in ("PYTEST_CURRENT_TEST", "CI", "DISTLAB_HEADLESS"):
            env.pop(name, None)
        return env

    def __enter__(self) -> JupyterLab:
        env = self._prepare_home()
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                   f"--ServerApp.port={_free_port()}",
                   f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
                   f"--LabApp.user_settings_dir={self._dirs['settings']}",
                   f"--LabApp.workspaces_dir={self._dirs['workspaces']}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--ServerApp.allow_root=True")  # CI containers run as root
        with open(self.log_path, "wb") as log:
            self.proc = psutil.Popen(command, cwd=self.root_dir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, preexec_fn=_end_with_parent)
        try:
            self._wait_until_serving()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_serving(self) -> None:
        """Wait for the server's runtime file (its real port) and a 200 from /api/status."""
        deadline = time.monotonic() + self.start_timeout
        info_file = self._dirs["runtime"] / f"jpserver-{self.proc.pid}.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode} before serving:\n"
                                   f"{self.log_tail()}")
            if self.port is None and info_file.exists():
                try:
                    self.port = json.loads(info_file.read_text())["port"]
                except (ValueError, KeyError):
                    pass  # written but not flushed yet
            if self.port is not None:
                try:
                    with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=10) as reply:
                        if reply.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"JupyterLab did not answer /api/status within {self.start_timeout:.0f} s "
                           f"(port {self.port}); log {self.log_path}:\n{self.log_tail()}")

    def kernels(self) -> list[psutil.Process]:
        """The kernel processes this server started (their command line runs ipykernel_launcher)."""
        found = []
        for proc in self.proc.children(recursive=True):
            try:
                if "ipykernel_launcher" in " ".join(proc.cmdline()):
                    found.append(proc)
            except psutil.NoSuchProcess:
                pass
        return found

    def shutdown_kernels(self, timeout: float = 60.0) -> None:
        """Shut down every kernel through the server's REST API, as the Kernel menu does, and wait for their
        processes to end (a kernel ends its ranks as it exits): one test's kernels never outlive it."""
        api = f"{self.url}/api/kernels"
        with urllib.request.urlopen(f"{api}?token={self.token}", timeout=30) as reply:
            ids = [kernel["id"] for kernel in json.load(reply)]
        for kernel_id in ids:
            request = urllib.request.Request(f"{api}/{kernel_id}?token={self.token}", method="DELETE")
            urllib.request.urlopen(request, timeout=timeout).close()
        deadline = time.monotonic() + timeout
        while [k for k in self.kernels() if alive(k)] and time.monotonic() < deadline:
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __exit__(self, *exc_info) -> None:
        if self.proc is not None:
            self.left_behind = stop_processes(process_tree(self.proc))
            self.proc = None


def _free_port() -> int:
    """A port free a moment ago; if another process takes it first, the server tries the next
    ones, and the runtime file tells us which it got."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Chromium:
    """Debian's Chromium driven by selenium through its chromedriver; use it as a context manager.

    `driver` is the selenium WebDriver. Leaving the block quits the browser and ends the whole
    process tree under chromedriver; `left_behind` then lists anything that survived.
    """

    def __init__(self, browser: str, chromedriver: str, home: Path):
        self.browser, self.chromedriver, self.home = browser, chromedriver, Path(home)
        self.log_path = self.home / "chromedriver.log"
        self.driver = None
        self.left_behind: list[psutil.Process] = []

    def __enter__(self) -> Chromium:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.home.mkdir(parents=True, exist_ok=True)
        options = webdriver.ChromeOptions()
        options.binary_location = self._browser_ending_with_chromedriver()
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.home / 'profile'}")
        # Given both paths, selenium never runs selenium-manager (which would try to download a driver).
        self._service = Service(executable_path=self.chromedriver, log_output=str(self.log_path),
                                popen_kw={"preexec_fn": _end_with_parent})
        try:
            self.driver = webdriver.Chrome(options=options, service=self._service)
        except BaseException:
            self.__exit__(None, None, None)  # a chromedriver that started must not outlive the failure
            raise
        return self

    def _browser_ending_with_chromedriver(self) -> str:
        """The browser, started through `setpriv --pdeathsig` where util-linux has it, so that a
        test run killed outright (chromedriver then dies by `_end_with_parent`) takes Chromium
        with it instead of leaving it orphaned; SIGTERM lets Chromium end its own helpers."""
        setpriv = shutil.which("setpriv")
        if not setpriv:
            return self.browser
        wrapper = self.home / "chromium"
        command = f"exec {shlex.quote(setpriv)} --pdeathsig TERM {shlex.quote(self.browser)}"
        wrapper.write_text(f'#!/bin/sh\n{command} "$@"\n')
        wrapper.chmod(0o755)
        return str(wrapper)

    def __exit__(self, *exc_info) -> None:
        process = getattr(self._service, "process", None)
        tree = process_tree(psutil.Process(process.pid)) if process and process.poll() is None else []
        try:
            if self.driver is not None:
                self.driver.quit()
        except Exception:  # a browser that hung or crashed is still ended below
            pass
        self.left_behind = stop_processes(tree, grace=5.0)


# One round trip reads the notebook's state: code cells, their prompts ("[7]:" once run, "[*]:"
# while queued), and the kernel's name and status as the toolbar shows them ("No Kernel" and
# "idle" before the session has started one).
NOTEBOOK_STATE_JS = """
const panel = document.querySelector('.jp-NotebookPanel');
const notebook = panel && panel.querySelector('.jp-Notebook');
if (!notebook) return null;
const prompts = [...notebook.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
const name = panel.querySelector('.jp-KernelName');
return {prompts: prompts, kernel: indicator ? indicator.dataset.status : null,
        kernel_name: name ? name.innerText.trim() : null};
"""


class NotebookPage:
    """The JupyterLab page of one open notebook, driven through the UI; screenshots go to `shots`.

    Every wait polls a condition with a deadline and, on time-out, saves a screenshot and fails
    saying what it waited for: a loaded machine is slow, never silently wrong.
    """

    def __init__(self, driver, shots: Path):
        self.driver, self.shots = driver, Path(shots)

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    @contextmanager
    def screenshot_on_failure(self):
        """A failure in the block (an assertion, or selenium losing an element or the browser)
        saves the page and names the screenshot in its message."""
        try:
            yield
        except Exception as failure:
            if "screenshot:" in str(failure):  # wait_for took one already
                raise
            try:
                shot = self.screenshot("failure")
            except Exception as why:  # a browser that crashed takes no screenshot
                shot = f"none ({type(why).__name__})"
            what = str(failure) if isinstance(failure, AssertionError) else f"{type(failure).__name__}: {failure}"
            cause = None if isinstance(failure, AssertionError) else failure
            raise AssertionError(f"{what}\nscreenshot: {shot}") from cause

    def wait_for(self, what: str, condition, timeout: float, poll: float = 0.25):
        """Return condition()'s first truthy value; fail after `timeout` s with a screenshot."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                slug = "".join(c if c.isalnum() else "-" for c in what)[:60].strip("-")
                shot = self.screenshot(f"timeout-{slug}")
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; screenshot: {shot}")
            time.sleep(poll)

    def state(self) -> dict | None:
        return self.driver.execute_script(NOTEBOOK_STATE_JS)

    def open(self, url: str, timeout: float) -> dict:
        """Load JupyterLab at `url` in a fresh workspace (``reset``: a server shared by several tests would
        otherwise reopen the notebooks of the tests before) and wait for the notebook's cells and its kernel,
        started and idle."""
        self.driver.get(url + ("&" if "?" in url else "?") + "reset")

        def ready():
            s = self.state()
            return s and s["prompts"] and s["kernel_name"] == KERNEL_NAME and s["kernel"] == "idle" and s

        return self.wait_for(f"the notebook to render with its kernel '{KERNEL_NAME}' idle", ready, timeout)

    def menu(self, menu: str, item: str, timeout: float = 30) -> None:
        """Click `menu` in the menu bar, then its enabled item labelled `item`, as a user would."""
        from selenium.webdriver.common.by import By

        def visible(xpath):
            found = [e for e in self.driver.find_elements(By.XPATH, xpath) if e.is_displayed()]
            return found[0] if found else None

        self.wait_for(f"the {menu} menu", lambda: visible(
            f"//div[contains(@class,'lm-MenuBar-itemLabel') and normalize-space()='{menu}']"), timeout).click()
        self.wait_for(f"the menu item {menu} > {item}", lambda: visible(
            f"//li[contains(@class,'lm-Menu-item') and not(contains(@class,'lm-mod-disabled'))]"
            f"[.//div[contains(@class,'lm-Menu-itemLabel') and normalize-space()='{item}']]"), timeout).click()

    def run_all(self, timeout: float) -> dict:
        """Run > Run All Cells, then wait until the queue has drained: the kernel idle, no cell
        waiting ("[*]:"), and cells with execution counts. A cell that raises ends the run there:
        the cells after it keep an empty prompt, which the caller sees in the returned prompts."""
        self.menu("Run", "Run All Cells")
        return self.wait_until_drained(timeout)

    def wait_until_drained(self, timeout: float) -> dict:
        """Wait for the cells queued by Run All to have run (see :meth:`run_all`)."""

        def drained():
            s = self.state()
            ran = s and any(re.fullmatch(r"\[\d+\]:", p) for p in s["prompts"])
            return ran and s["kernel"] == "idle" and "[*]:" not in s["prompts"] and s

        return self.wait_for("Run All Cells to finish with the kernel idle", drained, timeout)

    def scroll_to(self, element, where: str = "start") -> None:
        self.driver.execute_script("arguments[0].scrollIntoView({block: arguments[1]});", element, where)
