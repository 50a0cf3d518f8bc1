//! `verify --html`: the campaign page as headless Chromium shows it — what its script drew
//! (read from the DOM after it ran, by a probe script added to a copy of the page) and the
//! pixels of a screenshot. Chromium is Debian's, installed by the first test that needs it.

use crate::support;

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::*;

/// Ends a `<script>` element and injects an element with a handler, if anything lets it through.
const HOSTILE: &str = "</script><img src=x onerror=alert(1)>";
const CHROMIUM: &str = "/usr/bin/chromium";
/// The page's colours (page.css): failure, action, compensation.
const FAIL: [u8; 3] = [0xd6, 0x28, 0x39];
const ACTION: [u8; 3] = [0x2f, 0x6f, 0xdf];
const COMPENSATION: [u8; 3] = [0x8e, 0x44, 0xad];
/// One window size for the probe and the screenshot, so both see the same layout.
const WINDOW: (u32, u32) = (1280, 4000);

/// Debian's Chromium, installed if it is missing; a failed install fails the test loudly.
fn chromium() -> &'static Path {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| {
        if Path::new(CHROMIUM).exists() {
            return;
        }
        for args in [&["update"][..], &["install", "-y", "chromium"]] {
            let out = Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .output()
                .expect("apt-get runs (the test set-up installs Debian's chromium with it)");
            assert!(out.status.success(), "apt-get {args:?} failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
        }
        assert!(Path::new(CHROMIUM).exists(), "apt-get installed chromium, but {CHROMIUM} is missing");
    });
    Path::new(CHROMIUM)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Headless Chromium with its own profile, at [`WINDOW`], one device pixel per CSS pixel.
fn run_chromium(page: &Path, mode: &str) -> Output {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .args(["--disable-extensions", "--force-device-scale-factor=1", "--virtual-time-budget=2000"])
        .arg(format!("--window-size={},{}", WINDOW.0, WINDOW.1))
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(mode)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium runs");
    let out = finish_within(out, CHROMIUM_TIME_LIMIT, mode);
    assert!(out.status.success(), "chromium {mode} failed:\n{}", text(&out.stderr));
    out
}

/// Longer than any page here takes; a page that blocks (an `alert` an injected handler
/// opened) fails the test instead of hanging it.
const CHROMIUM_TIME_LIMIT: Duration = Duration::from_secs(90);

/// The output of `child`, killed if it has not ended within `limit`.
fn finish_within(mut child: Child, limit: Duration, what: &str) -> Output {
    // Read both pipes on threads, so a full pipe cannot stall the child.
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut buf = Vec::new();
        stdout.read_to_end(&mut buf).map(|_| buf).unwrap_or_default()
    });
    let err = std::thread::spawn(move || {
        let mut buf = Vec::new();
        stderr.read_to_end(&mut buf).map(|_| buf).unwrap_or_default()
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium {what} did not finish within {limit:?} (a dialog or a script blocked the page?)");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// The DOM of `page` after its scripts ran.
fn dump_dom(page: &Path) -> String {
    let dom = text(&run_chromium(page, "--dump-dom").stdout);
    assert!(dom.contains("</html>"), "chromium dumped no DOM: {dom}");
    dom
}

/// Reads what the page shows, from inside Chromium, after the page's own script ran.
const PROBE: &str = r##"<script>
(() => {
  const text = (root, sel) => { const e = root.querySelector(sel); return e ? e.innerText : null; };
  const count = (root, sel) => root.querySelectorAll(sel).length;
  const box = (e) => { if (!e) return null; const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
  const cells = (tr) => [...tr.cells].map((td) => td.innerText);
  const cards = {};
  for (const c of document.querySelectorAll(".card")) cards[c.id] = c.querySelector(".value").innerText;
  const articles = [...document.querySelectorAll("article.case")].map((a) => ({
    saga: a.closest("section.saga").querySelector("h2").innerText,
    id: text(a, ".case-id"),
    badge: text(a, ".badge"),
    action_bars: count(a, ".timeline rect.bar.action"),
    compensation_bars: count(a, ".timeline rect.bar.compensation"),
    failed_bars: count(a, ".timeline rect.bar.failed"),
    faults: count(a, ".timeline polygon.fault:not(.missed)"),
    rollback_lines: count(a, ".timeline line.rollback"),
    lanes: [...a.querySelectorAll(".timeline svg > text > title")].map((t) => t.textContent),
    timeline: box(a.querySelector(".timeline svg")),
    diff: [...a.querySelectorAll("tr.diff-row")].map(cells),
    documents: [...a.querySelectorAll("details.whole pre")].map((p) => p.textContent),
    replay: text(a, ".replay-cmd"),
  }));
  const probe = {
    title: document.title,
    verdict: text(document, "#verdict"),
    cards,
    by_kind: [...document.querySelectorAll("#by-kind tbody tr")].map(cells),
    by_saga: [...document.querySelectorAll("#by-saga tbody tr")].map(cells),
    articles,
    passing_rows: count(document, "tr.case-row"),
    mini_timelines: count(document, "svg.tl.mini"),
    active: count(document, "img, iframe, object, embed, [onerror], [onload]"),
    scripts: document.scripts.length,
    alerted: document.documentElement.getAttribute("data-alerted"),
  };
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(probe);
  document.body.append(out);
})();
</script>
"##;

/// Records any dialog a script opens (as an injected `onerror=alert(1)` would).
const TRAP_DIALOGS: &str = "<script>window.alert = window.confirm = window.prompt = \
    () => document.documentElement.setAttribute('data-alerted', 'yes');</script>\n";

/// What `page` shows, as [`PROBE`] reads it from a copy of the page.
fn probe(page: &Path) -> Value {
    let html = std::fs::read_to_string(page).unwrap();
    let end = html.rfind("</body>").expect("the page has a body");
    let head = html.find("<head>").expect("the page has a head") + "<head>".len();
    let probed = format!("{}\n{TRAP_DIALOGS}{}{PROBE}{}", &html[..head], &html[head..end], &html[end..]);
    let copy = page.with_extension("probe.html");
    std::fs::write(&copy, probed).unwrap();
    let dom = dump_dom(&copy);
    let start = dom.find("<pre id=\"probe\">").expect("the probe ran") + "<pre id=\"probe\">".len();
    let end = start + dom[start..].find("</pre>").unwrap();
    let json =
        dom[start..end].replace("&lt;", "<").replace("&gt;", ">").replace("&nbsp;", "\u{a0}").replace("&amp;", "&");
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("probe output is not JSON ({e}): {json}"))
}

/// A screenshot of `page`: width and RGB rows.
struct Screenshot {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Screenshot {
    fn of(page: &Path) -> Screenshot {
        let file = page.with_extension("png");
        run_chromium(page, &format!("--screenshot={}", file.display()));
        let mut decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&file).unwrap()));
        decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        let channels = info.color_type.samples();
        assert!(channels >= 3, "a screenshot in {:?}", info.color_type);
        let rgb = buf[..info.buffer_size()].chunks(channels).flat_map(|p| [p[0], p[1], p[2]]).collect();
        Screenshot { width: info.width as usize, height: info.height as usize, rgb }
    }

    /// Pixels of `colour` (give or take rounding) inside `[left, top, width, height]`.
    fn count(&self, area: &Value, colour: [u8; 3]) -> usize {
        let n = |i: usize| area[i].as_f64().unwrap().max(0.0) as usize;
        let (left, top) = (n(0), n(1));
        let (right, bottom) = ((left + n(2)).min(self.width), (top + n(3)).min(self.height));
        assert!(
            bottom > top && right > left,
            "the area {area} is outside the {}x{} screenshot",
            self.width,
            self.height
        );
        let close = |p: &[u8]| p.iter().zip(colour).all(|(a, b)| a.abs_diff(b) <= 4);
        (top..bottom)
            .flat_map(|y| (left..right).map(move |x| (y * self.width + x) * 3))
            .filter(|&i| close(&self.rgb[i..i + 3]))
            .count()
    }
}

/// Runs `sagabox verify` on `sagas` with `--html` (and `--report`) into `dir`; its stdout.
fn verify_html(sagas: &Path, dir: &Path, name: &str, extra: &[&str]) -> (PathBuf, Value) {
    let (page, report) = (dir.join(format!("{name}.html")), dir.join(format!("{name}.json")));
    let mut args = vec!["verify", sagas.to_str().unwrap(), "--html", page.to_str().unwrap()];
    args.extend(["--report", report.to_str().unwrap()]);
    args.extend(extra);
    let out = sagabox(&args);
    assert!(out.status.code().is_some(), "verify crashed: {}", text(&out.stderr));
    assert!(page.exists(), "no page written: {}{}", text(&out.stdout), text(&out.stderr));
    let report = serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    (page, report)
}

/// The saga with the buggy cancel, and a copy of it whose name, first step and fixture
/// carry [`HOSTILE`].
struct Campaign {
    dir: tempfile::TempDir,
    page: PathBuf,
    report: Value,
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn write_sagas(dir: &Path) -> PathBuf {
    let (sagas, shipped) = (dir.join("sagas"), sagas_dir().join("buggy-cancel"));
    std::fs::create_dir_all(&sagas).unwrap();
    for suffix in ["json", "fixture.json", "input.json"] {
        std::fs::copy(shipped.join(format!("buggy-cancel.{suffix}")), sagas.join(format!("buggy-cancel.{suffix}")))
            .unwrap();
        std::fs::copy(shipped.join(format!("buggy-cancel.{suffix}")), sagas.join(format!("hostile.{suffix}"))).unwrap();
    }
    let mut saga = read_json(&sagas.join("hostile.json"));
    saga["saga"]["name"] = json!(format!("hostile {HOSTILE}"));
    let flight = &mut saga["saga"]["steps"][0];
    assert_eq!(flight["id"], "flight");
    flight["id"] = json!(HOSTILE);
    flight["name"] = json!(HOSTILE);
    saga["saga"]["output"].as_object_mut().unwrap().remove("flight");
    std::fs::write(sagas.join("hostile.json"), saga.to_string()).unwrap();
    let mut fixture = read_json(&sagas.join("hostile.fixture.json"));
    fixture["flights"]["HAT001"]["note"] = json!(HOSTILE);
    std::fs::write(sagas.join("hostile.fixture.json"), fixture.to_string()).unwrap();
    sagas
}

fn campaign() -> &'static Campaign {
    static CAMPAIGN: OnceLock<Campaign> = OnceLock::new();
    CAMPAIGN.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let sagas = write_sagas(dir.path());
        let (page, report) = verify_html(&sagas, dir.path(), "page", &["--runs", "2"]);
        assert_eq!(report["totals"]["failed"].as_u64().map(|n| n > 0), Some(true), "the buggy cancel failed no case");
        Campaign { dir, page, report }
    })
}

fn probed() -> &'static Value {
    static PROBED: OnceLock<Value> = OnceLock::new();
    PROBED.get_or_init(|| probe(&campaign().page))
}

fn article<'a>(probe: &'a Value, saga: &str, id: &str) -> &'a Value {
    let articles = probe["articles"].as_array().unwrap();
    articles.iter().find(|a| a["saga"] == saga && a["id"] == id).unwrap_or_else(|| {
        panic!("no case {id} of {saga} shown; shown: {:?}", articles.iter().map(|a| &a["id"]).collect::<Vec<_>>())
    })
}

fn report_case<'a>(report: &'a Value, saga: &str, id: &str) -> &'a Value {
    let saga = report["sagas"].as_array().unwrap().iter().find(|s| s["saga"] == saga).unwrap();
    saga["cases"].as_array().unwrap().iter().find(|c| c["id"] == id).unwrap()
}

#[test]
fn the_summary_shows_the_campaigns_numbers() {
    let (probe, totals) = (probed(), &campaign().report["totals"]);
    let number = |v: &Value| v.as_u64().unwrap().to_string();
    assert_eq!(probe["cards"]["m-sagas"], "2");
    assert_eq!(probe["cards"]["m-cases"], number(&totals["cases"]));
    assert_eq!(probe["cards"]["m-passed"], number(&totals["passed"]));
    assert_eq!(probe["cards"]["m-failed"], number(&totals["failed"]));
    let failed = format!("FAILED: {} of {} cases failed", number(&totals["failed"]), number(&totals["cases"]));
    assert_eq!(probe["verdict"], failed.as_str());
    assert!(probe["cards"]["m-rate"].as_str().is_some_and(|r| r.parse::<f64>().is_ok()), "{}", probe["cards"]);

    // Every case is counted under one fault kind, and the failures under the ones that failed.
    let by_kind = probe["by_kind"].as_array().unwrap();
    let column = |i: usize| by_kind.iter().map(|row| row[i].as_str().unwrap().parse::<u64>().unwrap()).sum::<u64>();
    assert_eq!((column(1), column(3)), (totals["cases"].as_u64().unwrap(), totals["failed"].as_u64().unwrap()));
    let trap = by_kind.iter().find(|row| row[0] == "trap").expect("a trap row");
    assert_eq!(trap[1], "6", "3 steps x 2 sagas: {by_kind:?}");
    let sagas: Vec<&str> = probe["by_saga"].as_array().unwrap().iter().map(|r| r[0].as_str().unwrap()).collect();
    assert_eq!(sagas, ["buggy-cancel", &format!("hostile {HOSTILE}")]);
}

#[test]
fn a_failing_case_shows_its_timeline_diff_and_replay() {
    let (probe, report) = (probed(), &campaign().report);
    let shown = article(probe, "buggy-cancel", "hotel:trap");
    let case = report_case(report, "buggy-cancel", "hotel:trap");
    assert_eq!(case["verdict"], "fail");
    assert_eq!(shown["badge"], "FAIL");
    // Flight booked, the hotel trapped, the flight cancelled (without its seat).
    assert_eq!(case["compensated"], json!(["flight"]));
    assert_eq!(shown["action_bars"], 2, "{shown}");
    assert_eq!(shown["failed_bars"], 1, "{shown}");
    assert_eq!(shown["compensation_bars"], 1, "{shown}");
    assert_eq!(shown["faults"], 1, "{shown}");
    assert_eq!(shown["rollback_lines"], 1, "{shown}");
    assert_eq!(shown["lanes"].as_array().unwrap().len(), 3);
    assert_eq!(
        shown["diff"],
        json!([["changed", "flights/HAT001", "/dates/2024-05-16/available_seats/economy", "9", "8"]])
    );
    assert_eq!(shown["replay"], case["replay"]);
    assert!(shown["replay"].as_str().unwrap().ends_with("--seed 0 --case hotel:trap"), "{}", shown["replay"]);
    // Passing cases are listed (collapsed), each deterministic one with its small timeline.
    let cases = report["totals"]["cases"].as_u64().unwrap();
    let articles = probe["articles"].as_array().unwrap().len() as u64;
    assert_eq!(probe["passing_rows"].as_u64().unwrap() + articles, cases);

    // The pixels: the timeline has the failure colour (the trapped hotel and the fault
    // marker), the action colour and the compensation colour.
    let screenshot = Screenshot::of(&campaign().page);
    let area = &shown["timeline"];
    assert!(area[1].as_f64().unwrap() + area[3].as_f64().unwrap() < f64::from(WINDOW.1), "below the window: {area}");
    let (fail, action, compensation) =
        (screenshot.count(area, FAIL), screenshot.count(area, ACTION), screenshot.count(area, COMPENSATION));
    assert!(
        fail > 100 && action > 100 && compensation > 50,
        "{fail} failure, {action} action, {compensation} compensation pixels in {area}"
    );
    // And the summary above the cases shows none of the bars' colours.
    let summary = json!([0, 0, WINDOW.0, 80]);
    assert_eq!(screenshot.count(&summary, ACTION) + screenshot.count(&summary, COMPENSATION), 0);
}

#[test]
fn hostile_strings_show_as_text_and_inject_nothing() {
    let (probe, campaign) = (probed(), campaign());
    let html = std::fs::read_to_string(&campaign.page).unwrap();
    assert!(!html.contains(HOSTILE) && !html.contains("<img"), "the page carries the markup as it is");
    assert_eq!(probe["active"], 0, "an injected element exists");
    assert_eq!(probe["scripts"], 5, "the page's three, the dialog trap and the probe");
    assert_eq!(probe["alerted"], Value::Null, "an injected handler ran");

    let saga = format!("hostile {HOSTILE}");
    let shown = article(probe, &saga, &format!("{HOSTILE}:lost_response"));
    assert!(shown["lanes"][0].as_str().unwrap().starts_with(&format!("{HOSTILE} ({HOSTILE}): buggy_airline.book")));
    assert!(
        shown["replay"].as_str().unwrap().ends_with(&format!("--case '{HOSTILE}:lost_response'")),
        "{}",
        shown["replay"]
    );
    let clean = article(probe, &saga, "clean");
    let documents = clean["documents"].as_array().unwrap();
    assert!(
        documents.iter().all(|d| d.as_str().unwrap().contains(&format!("\"note\": \"{HOSTILE}\""))),
        "{documents:?}"
    );
    assert!(probe["title"].as_str().unwrap().starts_with("sagabox verify: FAILED"));

    // The raw DOM has the strings as escaped text.
    let dom = dump_dom(&campaign.page);
    assert!(
        dom.contains("&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;:lost_response"),
        "the hostile case id is not shown"
    );
    assert!(!dom.contains("<img"), "an img element was made");
}

#[test]
fn the_same_seed_writes_the_same_page_apart_from_its_timing_line() {
    let campaign = campaign();
    let sagas = campaign.dir.path().join("sagas");
    let (again, _) = verify_html(&sagas, campaign.dir.path(), "again", &["--runs", "2"]);
    let (other_seed, _) = verify_html(&sagas, campaign.dir.path(), "seed1", &["--runs", "2", "--seed", "1"]);
    let lines = |page: &Path| -> Vec<String> {
        let text = std::fs::read_to_string(page).unwrap();
        let timing = text.lines().filter(|l| l.contains("id=\"timing\"")).count();
        assert_eq!(timing, 1, "one timing line");
        text.lines().filter(|l| !l.contains("id=\"timing\"")).map(str::to_string).collect()
    };
    assert_eq!(lines(&campaign.page), lines(&again));
    assert_ne!(lines(&campaign.page), lines(&other_seed), "another seed drew the same random schedules");
}

#[test]
fn a_large_campaign_gives_a_compact_page_that_shows_every_case() {
    let dir = tempfile::tempdir().unwrap();
    let (page, report) = verify_html(&sagas_dir(), dir.path(), "large", &["--runs", "150"]);
    let cases = report["totals"]["cases"].as_u64().unwrap();
    assert!(cases > 1_200, "{cases} cases");
    let bytes = std::fs::metadata(&page).unwrap().len();
    let started = Instant::now();
    let probe = probe(&page);
    eprintln!("{cases} cases: a page of {bytes} bytes, probed in {:.1} s", started.elapsed().as_secs_f64());
    assert!(bytes < cases * 800, "{bytes} bytes for {cases} cases");
    assert_eq!(probe["cards"]["m-cases"], cases.to_string());
    let articles = probe["articles"].as_array().unwrap().len() as u64;
    assert_eq!(probe["passing_rows"].as_u64().unwrap() + articles, cases);
    // Each passing case run one step at a time has its small timeline; concurrent ones none.
    let all = report["sagas"].as_array().unwrap().iter().flat_map(|s| s["cases"].as_array().unwrap());
    let (serial, concurrent): (Vec<&Value>, Vec<&Value>) =
        all.filter(|c| c["verdict"] == "pass").partition(|c| c["mode"] == "deterministic");
    assert!(!concurrent.is_empty());
    assert_eq!(probe["mini_timelines"].as_u64().unwrap(), serial.len() as u64);
}
