//! `verify --html`: the campaign as one self-contained page — summary metrics, a timeline
//! per case, the diff and replay command of every failing case.
//!
//! The report is embedded once as JSON and drawn by a small inline script with DOM calls
//! that only ever set text, so nothing from a saga, plugin or state can become markup; the
//! JSON itself has `<`, `>` and `&` escaped so it cannot end its `<script>` element. The page
//! is byte-identical for the same report, except for the one line that carries the
//! wall-clock timing (`<script … id="timing">`).

pub mod timeline;

use serde::Serialize;

pub use timeline::{Bar, FaultMark, Lane, Outcome, Timeline};

use super::{CampaignReport, CaseReport, Expect, FaultKind, Metrics, Mode, SagaReport, Timing, Verdict};
use crate::saga::{Fault, Phase};
use crate::store::DiffEntry;

const STYLE: &str = include_str!("page.css");
const SCRIPT: &str = include_str!("page.js");

/// Longest text of one value or document shown in a diff; longer ones are cut.
const MAX_VALUE_CHARS: usize = 20_000;

/// The page of `report`, with `timing` on its own line.
pub fn render(report: &CampaignReport, timing: &Timing) -> String {
    let data = script_json(&Page::of(report));
    let timing = script_json(timing);
    let mut page = String::with_capacity(data.len() + STYLE.len() + SCRIPT.len() + 1024);
    page.push_str("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    page.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    page.push_str("<title>sagabox verify report</title>\n<style>\n");
    page.push_str(STYLE);
    page.push_str(
        "</style>\n</head>\n<body>\n<main id=\"app\"><noscript>This report is drawn by its inline script: \
                   open it with JavaScript enabled.</noscript></main>\n",
    );
    page.push_str("<script type=\"application/json\" id=\"report-data\">");
    page.push_str(&data);
    page.push_str("</script>\n<script type=\"application/json\" id=\"timing\">");
    page.push_str(&timing);
    page.push_str("</script>\n<script>\n");
    page.push_str(SCRIPT);
    page.push_str("</script>\n</body>\n</html>\n");
    page
}

/// `value` as JSON that can sit inside a `<script>` element: the characters that could end
/// it or start markup (only ever inside JSON strings) written as escapes.
fn script_json(value: &impl Serialize) -> String {
    let text = serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\":{:?}}}", e.to_string()));
    let mut out = String::with_capacity(text.len() + text.len() / 16);
    for c in text.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// The fault kind (as `--faults` names it) a case was built for; `clean` for the clean run.
pub fn kind_of(case: &CaseReport) -> &'static str {
    match case.expected {
        Expect::Baseline => return "clean",
        Expect::Invariants => return FaultKind::Random.name(),
        _ => {}
    }
    // A compensator case also rejects a later step to make the compensator run: its
    // compensation fault is what it is about.
    let compensation = case.faults.iter().find(|(_, phase, _)| *phase == Phase::Compensation);
    let kind = match compensation.or_else(|| case.faults.iter().next()) {
        Some((_, Phase::Compensation, Fault::Transient { .. })) => FaultKind::CompensatorTransient,
        Some((_, Phase::Compensation, Fault::Permanent)) => FaultKind::CompensatorPermanent,
        Some((_, _, Fault::Repeat)) => FaultKind::Repeat,
        Some((_, _, Fault::Rejected)) => FaultKind::Rejected,
        Some((_, _, Fault::Trap)) => FaultKind::Trap,
        Some((_, _, Fault::Fuel)) => FaultKind::Fuel,
        Some((_, _, Fault::Timeout)) => FaultKind::Timeout,
        Some((_, _, Fault::LostResponse)) => FaultKind::LostResponse,
        Some((_, _, Fault::Transient { .. })) => FaultKind::Transient,
        Some((_, Phase::Action, Fault::Permanent)) | None => return "other",
    };
    kind.name()
}

#[derive(Serialize)]
struct Page<'a> {
    sagabox: &'a str,
    seed: u64,
    runs: usize,
    faults: Vec<&'static str>,
    passed: bool,
    totals: &'a Metrics,
    by_kind: Vec<KindCount>,
    problems: &'a [String],
    sagas: Vec<SagaPage<'a>>,
}

impl<'a> Page<'a> {
    fn of(report: &'a CampaignReport) -> Page<'a> {
        Page {
            sagabox: report.sagabox,
            seed: report.seed,
            runs: report.runs,
            faults: report.faults.iter().map(|k| k.name()).collect(),
            passed: report.passed(),
            totals: &report.totals,
            by_kind: KindCount::of(report),
            problems: &report.problems,
            sagas: report.sagas.iter().map(SagaPage::of).collect(),
        }
    }
}

/// Cases of one fault kind, over every saga.
#[derive(Serialize)]
struct KindCount {
    kind: &'static str,
    cases: usize,
    passed: usize,
    failed: usize,
}

impl KindCount {
    /// In `--faults` order, the clean runs first; kinds without cases left out.
    fn of(report: &CampaignReport) -> Vec<KindCount> {
        let names = std::iter::once("clean").chain(FaultKind::ALL.iter().map(|k| k.name())).chain(["other"]);
        let cases: Vec<&CaseReport> = report.sagas.iter().flat_map(|s| &s.cases).collect();
        names
            .map(|kind| {
                let of_kind = cases.iter().filter(|c| kind_of(c) == kind);
                let (n, failed) =
                    of_kind.fold((0, 0), |(n, f), c| (n + 1, f + usize::from(c.verdict == Verdict::Fail)));
                KindCount { kind, cases: n, passed: n - failed, failed }
            })
            .filter(|k| k.cases > 0)
            .collect()
    }
}

#[derive(Serialize)]
struct SagaPage<'a> {
    name: &'a str,
    file: String,
    metrics: &'a Metrics,
    problems: &'a [String],
    steps: &'a [Lane],
    cases: Vec<CasePage<'a>>,
}

impl<'a> SagaPage<'a> {
    fn of(saga: &'a SagaReport) -> SagaPage<'a> {
        SagaPage {
            name: &saga.saga,
            file: saga.file.display().to_string(),
            metrics: &saga.metrics,
            problems: &saga.problems,
            steps: &saga.steps,
            cases: saga.cases.iter().map(CasePage::of).collect(),
        }
    }
}

#[derive(Serialize)]
struct CasePage<'a> {
    id: &'a str,
    kind: &'static str,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    concurrent: bool,
    pass: bool,
    expected: String,
    observed: &'static str,
    reason: &'a str,
    /// `[step, phase, fault]`.
    faults: Vec<(&'a str, &'static str, String)>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed_step: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    compensated: &'a [String],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    compensation_failed: &'a [String],
    /// Deterministic cases only: a concurrent run's order is a race.
    #[serde(skip_serializing_if = "Option::is_none")]
    timeline: Option<&'a Timeline>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    diff: Vec<DiffView<'a>>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    ledger_changes: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    replay: Option<&'a str>,
}

impl<'a> CasePage<'a> {
    fn of(case: &'a CaseReport) -> CasePage<'a> {
        let phase = |p: Phase| match p {
            Phase::Action => "action",
            Phase::Compensation => "compensation",
        };
        // Only failing cases bring their diff and replay command: a page of thousands of
        // passing cases stays small.
        let pass = case.verdict == Verdict::Pass;
        CasePage {
            id: &case.id,
            kind: kind_of(case),
            concurrent: case.mode == Mode::Concurrent,
            pass,
            expected: case.expected.to_string(),
            observed: case.observed.as_str(),
            reason: &case.reason,
            faults: case.faults.iter().map(|(step, p, fault)| (step, phase(p), fault.to_string())).collect(),
            failed_step: case.failed_step.as_deref(),
            compensated: &case.compensated,
            compensation_failed: &case.compensation_failed,
            timeline: case.timeline.as_ref(),
            diff: if pass { Vec::new() } else { case.diff.iter().map(DiffView::of).collect() },
            ledger_changes: &case.ledger_changes,
            replay: if pass { None } else { Some(&case.replay) },
        }
    }
}

/// A document that differs, with the fields that do and both whole documents.
#[derive(Serialize)]
struct DiffView<'a> {
    change: &'a str,
    namespace: &'a str,
    key: &'a str,
    /// `[field, expected, found]`.
    fields: Vec<[String; 3]>,
    expected: Option<String>,
    found: Option<String>,
}

impl<'a> DiffView<'a> {
    fn of(entry: &'a DiffEntry) -> DiffView<'a> {
        let pretty = |doc: &Option<serde_json::Value>| {
            doc.as_ref().map(|d| cut(serde_json::to_string_pretty(d).unwrap_or_default()))
        };
        DiffView {
            change: &entry.change,
            namespace: &entry.namespace,
            key: &entry.key,
            fields: super::field_changes(entry).into_iter().map(|row| row.map(cut)).collect(),
            expected: pretty(&entry.before),
            found: pretty(&entry.after),
        }
    }
}

/// `text`, cut to [`MAX_VALUE_CHARS`] with a note of how much was left out.
fn cut(text: String) -> String {
    match text.char_indices().nth(MAX_VALUE_CHARS) {
        Some((at, _)) => format!("{}… ({} more bytes)", &text[..at], text.len() - at),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_json_cannot_close_its_script_element() {
        let hostile = serde_json::json!({"s": "</script><img src=x onerror=alert(1)>&amp;\u{2028}"});
        let text = script_json(&hostile);
        assert!(!text.contains('<') && !text.contains('>') && !text.contains('&'), "{text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, hostile);
    }

    #[test]
    fn long_values_are_cut_at_a_character_boundary() {
        let text = "é".repeat(MAX_VALUE_CHARS + 5);
        let cut = cut(text);
        assert!(cut.starts_with(&"é".repeat(MAX_VALUE_CHARS)));
        assert!(cut.ends_with("… (10 more bytes)"), "{}", &cut[cut.len() - 30..]);
        assert_eq!(super::cut("short".into()), "short");
    }
}
