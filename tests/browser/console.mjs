// The browser side of the browser tests (tests/browser/main.rs): drives the
// console in Debian's headless Chromium with playwright-core, one scenario a
// run, named by the first argument.
//
// It talks to the Rust side in lines. On stdout: `VERSION …` first, then
// `STEP <name>` whenever the fleet must do something (the Rust side answers
// `OK` or `OK <value>` on stdin once it is done), then `PASS` or
// `FAIL <reason>`, one line. Details of a failure go to stderr.
//
// Environment: SHARDLINE_CONSOLE_URL (the console's base URL, ending in `/`),
// SHARDLINE_ADMIN_TOKEN, SHARDLINE_VIEWER_TOKEN, SHARDLINE_SHARDS (the shard
// count), SHARDLINE_WORKER (the worker's name), SHARDLINE_CHROMIUM (default:
// `chromium` on PATH), SHARDLINE_SCREENSHOTS_DIR (the screenshots scenario).

import { execFileSync } from "node:child_process";
import { accessSync, constants, readFileSync } from "node:fs";
import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const SETUP = "run scripts/browser-setup";
// Bound on every wait for the page; a replay job gets longer.
const WAIT_MS = 20_000;
const JOB_MS = 60_000;

const say = (line) => process.stdout.write(`${line}\n`);

class Failure extends Error {}

function fail(reason) {
  throw new Failure(reason);
}

function check(ok, reason) {
  if (!ok) {
    fail(reason);
  }
}

function env(name) {
  const value = process.env[name];
  if (value === undefined || value === "") {
    fail(`${name} is not set (the Rust side of tests/browser sets it)`);
  }
  return value;
}

// --- stdin: the Rust side's answers ---------------------------------------

const answers = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();

// Asks the Rust side to do `name`; its answer's value (after `OK `).
async function step(name) {
  say(`STEP ${name}`);
  const { value, done } = await answers.next();
  if (done) {
    fail(`stdin closed while waiting for the answer to STEP ${name}`);
  }
  check(value === "OK" || value.startsWith("OK "), `STEP ${name}: answered ${JSON.stringify(value)}`);
  return value.slice(3).trim();
}

// --- the browser ----------------------------------------------------------

function executable(file) {
  try {
    accessSync(file, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

// SHARDLINE_CHROMIUM, else `chromium` on PATH; the one line to fail with when neither is there.
function chromiumPath() {
  const given = process.env.SHARDLINE_CHROMIUM;
  if (given) {
    check(executable(given), `chromium not found at ${given} (SHARDLINE_CHROMIUM): ${SETUP} (apt-get install -y chromium)`);
    return given;
  }
  const found = (process.env.PATH || "")
    .split(path.delimiter)
    .map((dir) => path.join(dir || ".", "chromium"))
    .find(executable);
  check(found !== undefined, `chromium not found on PATH: ${SETUP} (apt-get install -y chromium)`);
  return found;
}

// Checks what the run needs and launches it; one line when something is missing.
async function launch() {
  const executablePath = chromiumPath();
  let chromiumVersion;
  try {
    // Debian's launcher script may warn on stderr; the version is on stdout.
    chromiumVersion = execFileSync(executablePath, ["--version"], {
      encoding: "utf8",
      stdio: ["ignore", "pipe", "ignore"],
    }).trim();
  } catch (e) {
    fail(`${executablePath} --version failed (${firstLine(e.message)}): reinstall it with apt-get install -y chromium`);
  }
  let playwright;
  let playwrightVersion;
  try {
    playwright = await import("playwright-core");
    playwrightVersion = JSON.parse(
      readFileSync(path.join(HERE, "node_modules", "playwright-core", "package.json"), "utf8"),
    ).version;
  } catch (e) {
    fail(`playwright-core is not installed in tests/browser/node_modules: ${SETUP} (npm ci --prefix tests/browser)`);
  }
  say(`VERSION ${chromiumVersion}; playwright-core ${playwrightVersion}`);
  try {
    return await playwright.chromium.launch({
      executablePath,
      headless: true,
      // The tests run as root, where Chromium's sandbox cannot start.
      args: ["--no-sandbox"],
    });
  } catch (e) {
    fail(
      `playwright-core ${playwrightVersion} cannot launch ${chromiumVersion} at ${executablePath} ` +
        `(${firstLine(e.message)}): ${SETUP}, or install a playwright-core that supports this Chromium`,
    );
  }
}

function firstLine(text) {
  return String(text).split("\n").find((l) => l.trim() !== "") ?? "";
}

// A playwright error in one line: what timed out and what it waited for.
function summary(e) {
  const lines = String(e.message)
    .replace(/\x1b\[[0-9;]*m/g, "")
    .split("\n")
    .map((l) => l.trim());
  const waited = lines.find((l) => /^(- )?waiting for /.test(l));
  return [firstLine(e.message).trim(), waited?.replace(/^- /, "")].filter(Boolean).join(" ");
}

// A page of a fresh context (no cookie) at 1280x800 that records dialogs,
// uncaught errors and Content-Security-Policy reports.
async function freshPage(browser) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  page.setDefaultTimeout(WAIT_MS);
  page.seen = { dialogs: [], errors: [], csp: [] };
  page.on("dialog", (dialog) => {
    page.seen.dialogs.push(`${dialog.type()}: ${dialog.message()}`);
    dialog.dismiss().catch(() => {});
  });
  page.on("pageerror", (e) => page.seen.errors.push(firstLine(e.message)));
  page.on("console", (m) => {
    if (m.type() === "error" && /Content Security Policy/i.test(m.text())) {
      page.seen.csp.push(firstLine(m.text()));
    }
  });
  return page;
}

function assertQuiet(page, where) {
  const { dialogs, errors, csp } = page.seen;
  check(dialogs.length === 0, `${where}: a dialog fired: ${dialogs.join(" | ")}`);
  check(errors.length === 0, `${where}: the page threw: ${errors.join(" | ")}`);
  check(csp.length === 0, `${where}: the Content-Security-Policy refused something: ${csp.join(" | ")}`);
}

// --- the console ----------------------------------------------------------

const BASE = () => env("SHARDLINE_CONSOLE_URL");
const url = (rest) => new URL(rest, BASE()).toString();

// Logs in through the form; the fleet page is next.
async function logInByForm(page, token) {
  await page.goto(url("login"));
  await page.fill("form.login input#token", token);
  const [response] = await Promise.all([
    page.waitForResponse((r) => r.url() === url("login") && r.request().method() === "POST"),
    page.click("form.login button[type=submit]"),
  ]);
  check(
    response.status() === 303,
    `the login form's POST: ${response.status()} ${firstLine(await response.text().catch(() => ""))} ` +
      `(the browser sent Origin: ${await response.request().headerValue("origin")})`,
  );
  await page.waitForURL(url(""));
  await page.waitForSelector("div#fleet");
}

// Logs in with the URL the console prints at start (`login?token=`); the
// scenarios but the first use it, so that they do not hang on the form.
async function logIn(page, token) {
  await page.goto(url(`login?token=${encodeURIComponent(token)}`));
  check(page.url() === url(""), `login?token= ended at ${page.url()}`);
  await page.waitForSelector("div#fleet");
}

async function deadLetters(page) {
  const response = await page.goto(url("dead-letters"));
  check(response.status() === 200, `GET dead-letters: ${response.status()}`);
}

const groupRow = (group) => `table#groups tr[data-group="${group}"]`;

// Waits for the failure group `group` with `count` letters on the dead-letters page.
async function seeGroup(page, group, count) {
  await deadLetters(page);
  await page.waitForSelector(groupRow(group));
  const cell = (await page.textContent(`${groupRow(group)} td.count`))?.trim();
  check(cell === String(count), `group ${group}: td.count says ${JSON.stringify(cell)}, expected ${count}`);
}

async function count(page, selector) {
  return page.locator(selector).count();
}

// A POST the way the page's own script sends one: JSON, with the CSRF
// token of the meta tag. Its status and body.
async function postJson(page, rest, body) {
  return page.evaluate(
    async ({ target, body }) => {
      const csrf = document.querySelector('meta[name="csrf-token"]')?.getAttribute("content") ?? "";
      const r = await fetch(target, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify(body),
      });
      return { status: r.status, text: await r.text(), csrf };
    },
    { target: url(rest), body },
  );
}

// --- the scenarios --------------------------------------------------------

const scenarios = {
  // Log in with the token through the form (a wrong one is refused); the
  // fleet page shows every shard of the running fleet, owned by the worker,
  // and keeps showing them after its refresh.
  async fleet(browser) {
    const shards = Number(env("SHARDLINE_SHARDS"));
    const worker = env("SHARDLINE_WORKER");
    const page = await freshPage(browser);
    // A wrong token first: refused, no cookie.
    await page.goto(url("login"));
    await page.fill("form.login input#token", "not-a-token-of-this-console");
    const [refused] = await Promise.all([
      page.waitForResponse((r) => r.url() === url("login") && r.request().method() === "POST"),
      page.click("form.login button[type=submit]"),
    ]);
    check(refused.status() === 401, `a wrong token at the login form: ${refused.status()} ${firstLine(await refused.text())}`);
    await page.waitForSelector("form.login .error");
    const cookies = await page.context().cookies();
    check(cookies.length === 0, `a refused login set cookies: ${cookies.map((c) => c.name).join(", ")}`);
    await logInByForm(page, env("SHARDLINE_ADMIN_TOKEN"));
    const rows = "div#fleet table#shards tr[data-shard]";
    await page.waitForFunction(
      ({ rows, shards, worker }) => {
        const all = [...document.querySelectorAll(rows)];
        return all.length === shards && all.every((r) => r.textContent.includes(worker));
      },
      { rows, shards, worker },
    ).catch(async (e) => {
      fail(`expected ${shards} rows ${rows} owned by ${worker}, saw ${await count(page, rows)} (${summary(e)})`);
    });
    const ids = await page.$$eval(rows, (all) => all.map((r) => r.getAttribute("data-shard")));
    const expected = [...Array(shards).keys()].map(String);
    check(
      JSON.stringify([...ids].sort((a, b) => a - b)) === JSON.stringify(expected),
      `data-shard values ${ids.join(",")}, expected 0..${shards - 1}`,
    );
    // The refresh replaces the table (server-rendered again).
    await page.$eval("div#fleet table#shards", (t) => t.setAttribute("data-seen", "1"));
    await page.waitForFunction(
      ({ rows, shards }) =>
        !document.querySelector("div#fleet table#shards[data-seen]") &&
        document.querySelectorAll(rows).length === shards,
      { rows, shards },
    ).catch((e) => fail(`div#fleet was not refreshed with ${shards} shards (${summary(e)})`));
    assertQuiet(page, "the fleet page");
  },

  // A permanent failure becomes a failure group on the dead-letters page.
  async "failure-group"(browser) {
    const page = await freshPage(browser);
    await logIn(page, env("SHARDLINE_ADMIN_TOKEN"));
    await deadLetters(page);
    check((await count(page, "tr[data-group]")) === 0, "a failure group before any failure");
    const group = await step("inject-failure");
    await seeGroup(page, group, 1);
    const row = (await page.textContent(groupRow(group))) ?? "";
    check(row.includes("handler"), `group ${group}'s row does not say reason handler: ${row}`);
    assertQuiet(page, "the dead-letters page");
  },

  // Fixed downstream, replay of the group from the page: the job ends done,
  // the group is gone; the Rust side checks the order's seqs downstream.
  async replay(browser) {
    const page = await freshPage(browser);
    await logIn(page, env("SHARDLINE_ADMIN_TOKEN"));
    const group = await step("inject-failure");
    await seeGroup(page, group, 1);
    await step("fix-downstream");
    await page.click(`${groupRow(group)} button.replay-group[data-group="${group}"]`);
    const job = "div#jobs div.job[data-job]";
    await page.waitForSelector(job);
    await page
      .waitForSelector(`${job}[data-state="done"]`, { timeout: JOB_MS })
      .catch(async (e) => {
        const state = await page.getAttribute(job, "data-state").catch(() => null);
        const progress = await page.textContent(`${job} .progress`).catch(() => null);
        fail(`the replay job did not reach done: data-state=${state}, progress ${JSON.stringify(progress)} (${summary(e)})`);
      });
    const progress = (await page.textContent(`${job}[data-state="done"] .progress`)) ?? "";
    check(/replayed 1 of 1/.test(progress), `the done job's progress says ${JSON.stringify(progress)}`);
    check((await count(page, `${job}[data-state="done"] button.cancel`)) === 0, "a done job still offers cancel");
    await deadLetters(page);
    await page
      .waitForSelector(groupRow(group), { state: "detached" })
      .catch(() => fail(`group ${group} is still listed after its replay`));
    await step("replayed");
    assertQuiet(page, "the dead-letters page");
  },

  // A read-only token sees no action and its POST is refused.
  async "read-only"(browser) {
    const page = await freshPage(browser);
    await logIn(page, env("SHARDLINE_VIEWER_TOKEN"));
    const group = await step("inject-failure");
    await seeGroup(page, group, 1);
    for (const action of [
      "button.replay-group",
      "form#release",
      "input.select",
      "button#replay-selected",
      "button#purge-selected",
      "input#replay-rate",
    ]) {
      check((await count(page, action)) === 0, `read-only sees ${action}`);
    }
    const replay = await postJson(page, "api/dlq/replay", { group });
    check(replay.csrf.length > 0, "the page has no CSRF token in meta[name=csrf-token]");
    check(replay.status === 403, `read-only POST api/dlq/replay: ${replay.status} ${replay.text}`);
    const release = await postJson(page, "api/dlq/release", { order_id: "anything" });
    check(release.status === 403, `read-only POST api/dlq/release: ${release.status} ${release.text}`);
    // The same CSRF token logs out: the 403s were for the role, not the token.
    const logout = await page.evaluate(async ({ target, csrf }) => {
      const r = await fetch(target, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/x-www-form-urlencoded" },
        body: new URLSearchParams({ csrf }).toString(),
      });
      return { status: r.status, url: r.url };
    }, { target: url("logout"), csrf: replay.csrf });
    check(logout.url === url("login"), `POST logout with the page's CSRF token: ${logout.status} at ${logout.url}`);
    await page.goto(url("dead-letters"));
    check(page.url() === url("login"), `after logout dead-letters is ${page.url()}`);
    await step("check-untouched");
    assertQuiet(page, "the dead-letters page");
  },

  // Without a token: 401 from the API, the login page for a page.
  async "no-token"(browser) {
    const page = await freshPage(browser);
    for (const api of ["api/fleet", "api/me", "api/dlq/groups"]) {
      const response = await page.goto(url(api));
      check(response.status() === 401, `GET ${api} without a token: ${response.status()}`);
    }
    for (const target of ["", "dead-letters", "dead-letters/letter/x", "audit"]) {
      await page.goto(url(target));
      check(page.url() === url("login"), `GET ${target || "/"} without a token ended at ${page.url()}`);
      await page.waitForSelector("form.login input#token");
    }
    const cookies = await page.context().cookies();
    check(cookies.length === 0, `cookies without a login: ${cookies.map((c) => c.name).join(", ")}`);
  },

  // Hostile bodies (script, bidi override, zero-width, invalid UTF-8) render
  // as text on the letter's page; nothing runs.
  async "hostile-body"(browser) {
    const page = await freshPage(browser);
    await logIn(page, env("SHARDLINE_ADMIN_TOKEN"));
    const [bytes, text] = (await step("publish-hostile")).split(" ");
    check(bytes && text, "publish-hostile: expected two letter ids");
    await deadLetters(page);
    await page.waitForSelector("tr[data-group]");
    await assertInert(page, "the dead-letters page");

    // Not UTF-8: shown as hex (class hex), or as escaped text.
    await letterPage(page, bytes);
    const raw = await bodyOf(page);
    if (raw.hex) {
      const digits = raw.text.replace(/[\s:|-]/g, "").toLowerCase();
      check(digits.includes(hexOf("<script>")), `the hex body does not hold <script>'s bytes: ${raw.text.slice(0, 200)}`);
    } else {
      for (const shown of ["<script>window.__pwned=1</script>", "\\u{202e}", "\\u{200b}", "\\x{ff}"]) {
        check(raw.text.includes(shown), `the body does not show ${JSON.stringify(shown)}: ${raw.text}`);
      }
    }
    await assertInert(page, "the letter page of the invalid UTF-8 body");

    // UTF-8 but not an envelope: escaped text with visible escapes.
    await letterPage(page, text);
    const shown = await bodyOf(page);
    check(!shown.hex, "a UTF-8 body is shown as hex");
    for (const part of ["<script>window.__pwned=1</script>", "<img src=x onerror=alert(1)>", "\\u{202e}", "\\u{200b}"]) {
      check(shown.text.includes(part), `the body does not show ${JSON.stringify(part)}: ${shown.text}`);
    }
    await assertInert(page, "the letter page of the UTF-8 body");
  },

  // The README's pictures (scripts/screenshots): the fleet and the dead letters.
  async screenshots(browser) {
    const dir = env("SHARDLINE_SCREENSHOTS_DIR");
    const page = await freshPage(browser);
    await logIn(page, env("SHARDLINE_ADMIN_TOKEN"));
    await page.waitForSelector("div#fleet table#shards tr[data-shard]");
    await step("fleet-busy");
    // The chart (a sample every 5 s) with a few samples of the backlog drawn.
    await page.waitForFunction(
      () =>
        [...document.querySelectorAll("svg#backlog-chart polyline")].some(
          (line) => (line.getAttribute("points") ?? "").trim().split(/\s+/).length >= 4,
        ),
      null,
      { timeout: 40_000 },
    );
    await page.screenshot({ path: path.join(dir, "console-fleet.png") });
    await deadLetters(page);
    await page.waitForSelector("tr[data-group]");
    await page.screenshot({ path: path.join(dir, "console-dead-letters.png") });
  },
};

async function letterPage(page, id) {
  const response = await page.goto(url(`dead-letters/letter/${encodeURIComponent(id)}`));
  check(response.status() === 200, `GET the page of letter ${id}: ${response.status()}`);
  await page.waitForSelector("pre#body");
}

async function bodyOf(page) {
  return page.$eval("pre#body", (pre) => ({
    text: pre.innerText,
    hex: pre.classList.contains("hex"),
    elements: pre.children.length,
  }));
}

function hexOf(text) {
  return Buffer.from(text, "utf8").toString("hex");
}

// Nothing of a hostile text ran or became markup.
async function assertInert(page, where) {
  const pwned = await page.evaluate(() => typeof window.__pwned);
  check(pwned === "undefined", `${where}: window.__pwned is ${pwned}`);
  const scripts = await count(page, "main script");
  check(scripts === 0, `${where}: ${scripts} <script> element(s) inside main`);
  const images = await count(page, "main img");
  check(images === 0, `${where}: ${images} <img> element(s) inside main`);
  const visible = await page.innerText("main");
  for (const [c, name] of [["\u202e", "U+202E"], ["\u200b", "U+200B"], ["\ufffd", "U+FFFD"]]) {
    check(!visible.includes(c), `${where}: the text shows a raw ${name} instead of an escape`);
  }
  assertQuiet(page, where);
}

// --- main -----------------------------------------------------------------

async function main() {
  const name = process.argv[2];
  const scenario = scenarios[name];
  if (!scenario) {
    fail(`no scenario ${JSON.stringify(name)}; there are ${Object.keys(scenarios).join(", ")}`);
  }
  const browser = await launch();
  try {
    await scenario(browser);
  } finally {
    await browser.close().catch(() => {});
  }
}

try {
  await main();
  say("PASS");
  process.exit(0);
} catch (e) {
  if (!(e instanceof Failure)) {
    process.stderr.write(`${e.stack ?? e}\n`);
  }
  say(`FAIL ${e instanceof Failure ? e.message : summary(e)}`);
  process.exit(1);
}
