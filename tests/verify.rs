//! Verification campaigns: reproducible, complete, and able to catch a wrong compensator.

use crate::support;

use std::path::Path;
use std::sync::Arc;

use sagabox::runtime::Runtime;
use sagabox::saga::{Fault, Phase, Saga, Status};
use sagabox::store::State;
use sagabox::store::fixture;
use sagabox::verify::{self, CampaignOptions, CampaignReport, Case, CaseHook, FaultKind, Mode, Subject, Verdict};
use serde_json::Value;
use support::*;
use tokio::sync::OnceCell;

async fn shared_runtime() -> Arc<Runtime> {
    static RUNTIME: OnceCell<Arc<Runtime>> = OnceCell::const_new();
    RUNTIME.get_or_init(|| async { Arc::new(runtime().await) }).await.clone()
}

async fn subject(path: &Path) -> Subject {
    let runtime = shared_runtime().await;
    let saga = Saga::load(path, &runtime).unwrap_or_else(|e| panic!("{e}"));
    let read = |p: &Option<std::path::PathBuf>| -> Option<Value> {
        p.as_ref().map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
    };
    Subject {
        // As the command line does: no fixture, an empty store.
        initial: saga.companions.fixture.as_ref().map_or_else(State::default, |f| fixture::load(f).unwrap()),
        input: read(&saga.companions.input).unwrap_or_default(),
        expected: read(&saga.companions.expected),
        saga: Arc::new(saga),
    }
}

async fn campaign(paths: &[&Path], seed: u64, runs: usize) -> CampaignReport {
    let mut subjects = Vec::new();
    for path in paths {
        subjects.push(subject(path).await);
    }
    let options = CampaignOptions { seed, runs, ..CampaignOptions::default() };
    verify::run_campaign(shared_runtime().await, &subjects, &options, &|_, _| {}).await.0
}

/// Saga inputs written for these tests.
fn data_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/verify")
}

fn shipped() -> Vec<std::path::PathBuf> {
    sagabox::saga::saga_files(&[sagas_dir()]).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_shipped_saga_passes_its_whole_campaign() {
    let paths = shipped();
    assert_eq!(paths.len(), 7);
    let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
    let report = campaign(&refs, 0, 25).await;
    for saga in &report.sagas {
        if let Some(case) = saga.cases.iter().find(|c| c.verdict == Verdict::Fail) {
            panic!("{} / {}: {} {:?}", saga.saga, case.id, case.reason, case.diff);
        }
        let kinds: Vec<&str> = saga.cases.iter().map(|c| c.id.rsplit(':').next().unwrap()).collect();
        for kind in ["clean", "rejected", "trap", "fuel", "timeout", "transient", "permanent", "repeat"] {
            assert!(kinds.contains(&kind), "{}: no '{kind}' case", saga.saga);
        }
        assert_eq!(saga.metrics.rollback_success_rate, 1.0, "{}", saga.saga);
        assert_eq!(saga.metrics.compensation_coverage, 1.0, "{}", saga.saga);
        assert_eq!(saga.plugins.len(), saga.plugins.values().filter(|s| s.len() == 64).count());
    }
    assert!(report.passed());
    assert!(report.totals.cases > 300, "{}", report.totals.cases);

    // Lost responses are compensated, and pass.
    let lost: Vec<_> =
        report.sagas.iter().flat_map(|s| &s.cases).filter(|c| c.id.ends_with(":lost_response")).collect();
    assert!(lost.len() >= 10);
    assert!(lost.iter().all(|c| c.verdict == Verdict::Pass && c.compensated.contains(&c.failed_step.clone().unwrap())));

    // A permanent compensator failure is reported as compensation_failed, with its residue.
    let permanent: Vec<_> =
        report.sagas.iter().flat_map(|s| &s.cases).filter(|c| c.id.ends_with(":compensation:permanent")).collect();
    assert!(!permanent.is_empty());
    for case in permanent {
        assert_eq!(case.observed, Status::CompensationFailed, "{}", case.id);
        assert!(!case.diff.is_empty(), "{}: no residue", case.id);
        assert_ne!(case.digest_after, case.digest_before);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_seed_gives_the_same_report_bytes_and_another_seed_other_schedules() {
    let paths = [sagas_dir().join("ct1-payment-failure.json"), sagas_dir().join("trip-dag.json")];
    let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
    let first = serde_json::to_string_pretty(&campaign(&refs, 42, 30).await).unwrap();
    let second = serde_json::to_string_pretty(&campaign(&refs, 42, 30).await).unwrap();
    assert_eq!(first, second, "the same seed gave different reports");
    assert!(!first.contains("_us\""), "the report carries wall-clock times");

    let schedules = |report: &CampaignReport| -> Vec<String> {
        report
            .sagas
            .iter()
            .flat_map(|s| &s.cases)
            .filter(|c| c.id.starts_with("random-") && c.mode == Mode::Deterministic)
            .map(|c| format!("{:?}", c.faults))
            .collect()
    };
    let a = campaign(&refs, 42, 30).await;
    let b = campaign(&refs, 43, 30).await;
    assert_eq!(schedules(&a).len(), 60);
    assert_ne!(schedules(&a), schedules(&b), "another seed drew the same schedules");
    assert!(b.passed() && a.passed());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compensator_that_forgets_the_seats_is_caught_with_its_diff() {
    let path = sagas_dir().join("buggy-cancel/buggy-cancel.json");
    let report = campaign(&[&path], 0, 5).await;
    assert!(!report.passed());
    let saga = &report.sagas[0];
    let clean = saga.cases.iter().find(|c| c.id == "clean").unwrap();
    assert_eq!(clean.verdict, Verdict::Fail);
    assert_eq!(clean.observed, Status::Failed, "the buggy rollback looks like a success to the saga");
    assert_eq!(clean.diff.len(), 1, "{:?}", clean.diff);
    let entry = &clean.diff[0];
    assert_eq!((entry.namespace.as_str(), entry.key.as_str(), &*entry.change), ("flights", "HAT001", "changed"));
    assert_eq!(entry.fields, ["/dates/2024-05-16/available_seats/economy"]);
    assert_eq!(
        entry.before.as_ref().unwrap().pointer("/dates/2024-05-16/available_seats/economy"),
        Some(&Value::from(9))
    );
    assert_eq!(
        entry.after.as_ref().unwrap().pointer("/dates/2024-05-16/available_seats/economy"),
        Some(&Value::from(8))
    );
    assert!(clean.replay.contains("--case clean"), "{}", clean.replay);
    // The bug shows whenever the flight is cancelled, and only then.
    for case in &saga.cases {
        let flight_undone = case.compensated.iter().any(|s| s == "flight");
        if flight_undone && case.observed == Status::Failed {
            assert_eq!(case.verdict, Verdict::Fail, "{}", case.id);
        }
    }
    let not_booked = saga.cases.iter().find(|c| c.id == "flight:rejected").unwrap();
    assert_eq!(not_booked.verdict, Verdict::Pass);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_case_can_be_replayed_alone_and_fault_kinds_can_be_chosen() {
    let path = sagas_dir().join("ct1-payment-failure.json");
    let subject = subject(&path).await;
    let only = CampaignOptions { seed: 9, only_case: Some("hotel:lost_response".into()), ..CampaignOptions::default() };
    let (report, timing) =
        verify::run_campaign(shared_runtime().await, std::slice::from_ref(&subject), &only, &|_, _| {}).await;
    let cases = &report.sagas[0].cases;
    assert_eq!(cases.len(), 1);
    assert_eq!(cases[0].faults.get("hotel", Phase::Action), Some(Fault::LostResponse));
    assert_eq!(timing.cases, 1);

    let random = CampaignOptions { seed: 9, only_case: Some("random-17".into()), ..CampaignOptions::default() };
    let (report, _) =
        verify::run_campaign(shared_runtime().await, std::slice::from_ref(&subject), &random, &|_, _| {}).await;
    assert_eq!(report.sagas[0].cases.len(), 1);
    assert_eq!(report.sagas[0].cases[0].id, "random-17");

    let kinds = CampaignOptions { kinds: vec![FaultKind::Trap], runs: 0, ..CampaignOptions::default() };
    let (report, _) = verify::run_campaign(shared_runtime().await, &[subject], &kinds, &|_, _| {}).await;
    let ids: Vec<&str> = report.sagas[0].cases.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["clean", "flight:trap", "hotel:trap", "payment:trap"]);
}

#[test]
fn the_cli_writes_identical_reports_and_fails_on_the_buggy_saga() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sagabox"))
            .args(args)
            .env("SAGABOX_CACHE_DIR", shared_cache())
            .output()
            .unwrap()
    };
    let sagas = sagas_dir();
    let report = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (a, b) = (report("a.json"), report("b.json"));
    let out = run(&["verify", sagas.to_str().unwrap(), "--seed", "5", "--runs", "10", "--report", &a]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let out = run(&["verify", sagas.to_str().unwrap(), "--seed", "5", "--runs", "10", "--report", &b]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(String::from_utf8_lossy(&out.stdout).contains("every case passed"));

    let buggy = sagas.join("buggy-cancel/buggy-cancel.json");
    let out = run(&["verify", buggy.to_str().unwrap(), "--runs", "3"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("changed flights/HAT001"), "{text}");
    assert!(text.contains("/dates/2024-05-16/available_seats/economy: 9 -> 8"), "{text}");
    assert!(text.contains("replay: sagabox verify"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completed_run_must_reach_the_declared_expected_state() {
    let dir = tempfile::tempdir().unwrap();
    for suffix in ["json", "input.json", "fixture.json", "expected.json"] {
        std::fs::copy(sagas_dir().join(format!("travel.{suffix}")), dir.path().join(format!("travel.{suffix}")))
            .unwrap();
    }
    let expected_path = dir.path().join("travel.expected.json");
    let mut expected: Value = serde_json::from_str(&std::fs::read_to_string(&expected_path).unwrap()).unwrap();
    assert_eq!(campaign(&[&dir.path().join("travel.json")], 0, 0).await.totals.failed, 0);

    expected["flights"]["HAT001"]["dates"]["2024-05-16"]["available_seats"]["economy"] = Value::from(8);
    std::fs::write(&expected_path, expected.to_string()).unwrap();
    let report = campaign(&[&dir.path().join("travel.json")], 0, 0).await;
    let clean = report.sagas[0].cases.iter().find(|c| c.id == "clean").unwrap();
    assert_eq!(clean.verdict, Verdict::Fail);
    assert!(clean.reason.contains("expected state"), "{}", clean.reason);
    assert_eq!(clean.diff[0].key, "HAT001");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_case_that_panics_fails_the_campaign_and_names_the_case() {
    let subject = subject(&sagas_dir().join("ct1-payment-failure.json")).await;
    let hook = CaseHook(Arc::new(|case: &Case| {
        if case.id == "hotel:trap" {
            panic!("provoked in the test");
        }
    }));
    let options = CampaignOptions { runs: 0, on_case: Some(hook), ..CampaignOptions::default() };
    let (report, timing) = verify::run_campaign(shared_runtime().await, &[subject], &options, &|_, _| {}).await;
    assert!(!report.passed(), "a campaign with a panicking case passed");
    let saga = &report.sagas[0];
    let problem = saga.problems.iter().find(|p| p.contains("'hotel:trap'")).unwrap_or_else(|| panic!("{saga:#?}"));
    assert!(problem.contains("panicked") && problem.contains("provoked in the test"), "{problem}");
    assert_eq!(saga.metrics.failed, 1, "the panicked case counts as a failed case");
    assert_eq!(saga.metrics.cases, timing.cases);
    // The other cases still ran and kept their verdicts.
    assert!(saga.cases.iter().any(|c| c.id == "flight:trap" && c.verdict == Verdict::Pass));
    assert!(!saga.cases.iter().any(|c| c.id == "hotel:trap"));
}

#[test]
fn shards_merged_give_the_single_process_report_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let sagas = sagas_dir().to_str().unwrap().to_string();
    // The shipped sagas and the buggy one, so that failing cases (with diffs) are merged too.
    let buggy = sagas_dir().join("buggy-cancel/buggy-cancel.json").to_str().unwrap().to_string();
    let campaign = |extra: &[&str]| {
        let mut args = vec!["verify", &sagas, &buggy, "--seed", "11", "--runs", "6"];
        args.extend_from_slice(extra);
        support::sagabox(&args)
    };
    let single = path("single.json");
    let out = campaign(&["--report", &single]);
    assert_eq!(out.status.code(), Some(1), "the buggy saga fails its campaign");
    let parts: Vec<String> = (1..=3).map(|i| path(&format!("part{i}.json"))).collect();
    for (i, part) in parts.iter().enumerate() {
        let shard = format!("{}/3", i + 1);
        let out = campaign(&["--shard", &shard, "--shard-report", part]);
        assert!(out.status.code().is_some_and(|c| c <= 1), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("shard {shard}:")));
    }
    // Merged in any order, the report is the single process's, and so is the verdict.
    let merged = path("merged.json");
    let out = campaign(&["--merge", &parts[2], &parts[0], &parts[1], "--report", &merged]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&merged).unwrap(), std::fs::read(&single).unwrap(), "the merged report differs");
    assert!(String::from_utf8_lossy(&out.stdout).contains("changed flights/HAT001"));

    // Parts that are not the whole campaign, or of another one, are refused by name.
    let out = campaign(&["--merge", &parts[0], &parts[1]]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("got shards 1/3, 2/3"), "{stderr}");
    let out = support::sagabox(&[
        "verify", &sagas, &buggy, "--seed", "12", "--runs", "6", "--merge", &parts[0], &parts[1], &parts[2],
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("part1.json") && stderr.contains("--seed 11"), "{stderr}");
}

#[test]
fn an_unknown_case_id_fails_naming_it_and_the_known_ones() {
    let saga = sagas_dir().join("ct1-payment-failure.json");
    let out = sagabox(&["verify", saga.to_str().unwrap(), "--case", "hotel:tarp"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "stdout: {stdout}\nstderr: {stderr}");
    assert!(!stdout.contains("every case passed"), "{stdout}");
    assert!(stderr.contains("'hotel:tarp'"), "{stderr}");
    assert!(stderr.contains("hotel:trap") && stderr.contains("clean"), "the known cases are not listed: {stderr}");

    // A known id still runs alone.
    let out = sagabox(&["verify", saga.to_str().unwrap(), "--case", "hotel:trap"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_library_fails_a_campaign_whose_case_filter_matches_nothing() {
    let subject = subject(&sagas_dir().join("ct1-payment-failure.json")).await;
    let options = CampaignOptions { only_case: Some("no-such-case".into()), ..CampaignOptions::default() };
    let (report, _) = verify::run_campaign(shared_runtime().await, &[subject], &options, &|_, _| {}).await;
    assert!(!report.passed(), "zero cases run, and the campaign passed");
    assert!(report.problems.iter().any(|p| p.contains("'no-such-case'")), "{:?}", report.problems);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clean_run_rejected_for_want_of_a_fixture_fails_the_campaign_with_a_hint() {
    let path = data_dir().join("no-fixture.json");
    let report = campaign(&[&path], 0, 3).await;
    assert!(!report.passed(), "a saga whose clean run is rejected at step 1 verified green");
    let problems = &report.sagas[0].problems;
    let problem = problems.first().unwrap_or_else(|| panic!("no problem reported: {report:#?}"));
    assert!(problem.contains("the clean run did not complete: rejected at step 'flight'"), "{problem}");
    assert!(problem.contains("no fixture") && problem.contains("no-fixture.fixture.json"), "{problem}");

    let out = sagabox(&["verify", path.to_str().unwrap(), "--runs", "2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("the clean run did not complete: rejected at step 'flight'"), "{stdout}");
    assert!(!stdout.contains("every case passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clean_run_that_fails_before_any_rollback_fails_the_campaign_even_with_a_fixture() {
    let report = campaign(&[&data_dir().join("first-step-rejected.json")], 0, 3).await;
    assert!(!report.passed());
    let problem = report.sagas[0].problems.first().unwrap_or_else(|| panic!("no problem reported: {report:#?}"));
    assert!(problem.contains("the clean run did not complete: rejected at step 'flight'"), "{problem}");
    assert!(!problem.contains("no fixture"), "{problem}");
}

#[tokio::test(flavor = "multi_thread")]
async fn dag_campaigns_also_run_every_case_concurrently_with_identical_report_bytes() {
    let dag = sagas_dir().join("trip-dag.json");
    let report = campaign(&[&dag], 7, 6).await;
    let json = serde_json::to_value(&report).unwrap();
    let cases = json["sagas"][0]["cases"].as_array().unwrap();
    let ids = |mode: &str| -> Vec<String> {
        cases.iter().filter(|c| c["mode"] == mode).map(|c| c["id"].as_str().unwrap().to_string()).collect()
    };
    let (serial, concurrent) = (ids("deterministic"), ids("concurrent"));
    assert!(!serial.is_empty() && serial.len() == concurrent.len(), "{serial:?} / {concurrent:?}");
    for id in &serial {
        assert!(concurrent.contains(&format!("{id}@concurrent")), "no concurrent twin of {id}");
    }
    for case in cases.iter().filter(|c| c["mode"] == "concurrent") {
        assert_eq!(case["verdict"], "pass", "{case:#}");
        // Only facts that do not depend on scheduling.
        assert!(case.get("compensated").is_none() && case.get("failed_step").is_none(), "{case:#}");
    }
    assert!(report.passed());

    let again = campaign(&[&dag], 7, 6).await;
    let bytes = |r: &CampaignReport| serde_json::to_string_pretty(r).unwrap();
    assert_eq!(bytes(&report), bytes(&again), "the same seed gave different reports");

    // A chain has nothing to run at once: no concurrent twins.
    let chain = campaign(&[&sagas_dir().join("ct1-payment-failure.json")], 7, 2).await;
    assert!(chain.sagas[0].cases.iter().all(|c| !c.id.ends_with("@concurrent")));
}
