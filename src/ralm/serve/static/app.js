// The page talks to the same JSON API that `ralm serve` documents at /docs; nothing is loaded
// from anywhere else.
const $ = (id) => document.getElementById(id);

const STATS_POLL_MS = 3000;  // the status line follows hot index swaps within this
const EXCERPT_CHARS = 300;  // longer evidence blocks show an excerpt around the answer, expandable
const BLOCKS_SHOWN = 3;  // evidence blocks listed at first (and the answer's block); the rest one click away
const FILES_PER_PAGE = 10;  // the index's files listed at a time

// Calibrated confidence in words (docs/serving.md and static/confidence.html list the same bands).
// The bands under 50 % word a withheld guess only: an answer the server shows reached its
// threshold, and under 50 % it is "uncertain" (check the evidence), never "likely wrong".
const BANDS = [
  [0.9, "very likely right", "high"],
  [0.7, "likely right", "high"],
  [0.5, "more likely right than wrong", "mid"],
  [0.3, "more likely wrong than right", "low"],
  [0, "likely wrong", "low"],
];
const UNCERTAIN = [0, "uncertain", "mid"];  // a shown answer under 50 %
const SIDES = { dense: "dense", bm25: "BM25" };
const SIDE_HELP = { dense: "found by meaning (dense retriever)", bm25: "found by shared words (BM25)" };
const KIND_LABELS = { hybrid: "Meaning + keywords (hybrid)", dense: "Meaning (dense)", bm25: "Keywords (BM25)" };

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function percent(p) {
  return `${Math.round(100 * p)}\u00a0%`;
}

// The band of the percentage shown, so that the words and the number agree (0.895 is "90 %":
// very likely right); `shown`: an answer the server gave (not withheld), which is never worded
// as more likely wrong than right.
function band(p, shown) {
  const found = BANDS.find(([lo]) => Math.round(100 * p) >= 100 * lo);
  return shown && found[0] < 0.5 ? UNCERTAIN : found;
}

// "likely right — 87 %", "uncertain — 43 %: check the evidence" (a shown answer under 50 %),
// "likely wrong — 12 %" (a withheld guess), or the raw score's caveat for a reader that was
// never calibrated.
function confidenceText(confidence, score, shown) {
  if (confidence === null || confidence === undefined) {
    return `confidence unknown: the reader is not calibrated (raw score ${score.toFixed(2)}, not a probability of being right)`;
  }
  const words = band(confidence, shown);
  return `${words[1]} — ${percent(confidence)}` + (words === UNCERTAIN ? ": check the evidence" : "");
}

// `body`: JSON, or a File sent as it is (POST /documents/file). The page is the server's own
// origin, so the browser's Origin header passes the server's cross-origin check.
async function api(path, body, method = "POST", key = "") {
  const raw = body instanceof Blob;
  const headers = { "Content-Type": raw ? "application/octet-stream" : "application/json" };
  if (key) headers["X-API-Key"] = key;
  const res = await fetch(path, { method, headers, body: raw ? body : body ? JSON.stringify(body) : undefined });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const err = new Error(data.error || `HTTP ${res.status}`);
    err.status = res.status;
    throw err;
  }
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// ---- the answer card -------------------------------------------------------------------------

function renderAnswer(r) {
  const best = r.evidence[r.best ?? 0];
  // "guess": the best span even when withheld (newer servers); older ones hold it in the evidence.
  const guess = r.guess ?? best?.answer ?? "";
  const card = $("answer");
  card.hidden = false;
  card.classList.toggle("withheld", Boolean(r.no_answer));
  $("confidence").className = "confidence";
  if (r.no_answer) {
    $("answer-text").textContent = "No answer found in the corpus";
    $("confidence").textContent = guess
      ? "The best guess is below the confidence this server needs to answer."
      : "The reader found no answer in the passages it read.";
    $("guess").hidden = !guess;
    $("guess").innerHTML = guess
      ? `Best guess: “${escapeHtml(guess)}” (${escapeHtml(confidenceText(r.confidence, r.score, false))})`
      : "";
  } else {
    $("answer-text").textContent = r.answer;
    $("confidence").textContent = confidenceText(r.confidence, r.score, true);
    if (r.confidence !== null && r.confidence !== undefined) $("confidence").classList.add(band(r.confidence, true)[2]);
    $("guess").hidden = true;
  }
  $("confidence-help").querySelector("summary").textContent =
    r.confidence === null || r.confidence === undefined ? "Why no confidence?" : `What does ${percent(r.confidence)} mean?`;
}

// ---- the evidence list -----------------------------------------------------------------------

// The API's spans count code points (Python's str); a JavaScript string indexes UTF-16 units,
// two for an emoji: the span in those units.
function utf16Span(text, span) {
  if (!span) return null;
  const points = Array.from(text);
  return span.map((n) => points.slice(0, n).join("").length);
}

// `text` with [a, b) (UTF-16 units) marked; `kind`: "answer" or "guess".
function marked(text, span, kind) {
  if (!span) return escapeHtml(text);
  const [a, b] = span;
  return escapeHtml(text.slice(0, a)) + `<mark class="span-${kind}">` + escapeHtml(text.slice(a, b)) + "</mark>" + escapeHtml(text.slice(b));
}

// A window of about EXCERPT_CHARS around the span (or the start), cut at spaces.
function excerpt(text, span, kind) {
  if (text.length <= EXCERPT_CHARS) return null;
  const centre = span ? Math.floor((span[0] + span[1]) / 2) : 0;
  let a = Math.max(0, Math.min(centre - EXCERPT_CHARS / 2, text.length - EXCERPT_CHARS));
  let b = Math.min(text.length, a + EXCERPT_CHARS);
  if (span) { a = Math.min(a, span[0]); b = Math.max(b, span[1]); }
  if (a > 0) a = Math.max(text.lastIndexOf(" ", a) + 1, 0);
  if (b < text.length) { const space = text.indexOf(" ", b); b = space < 0 ? text.length : space; }
  const inner = span ? [span[0] - a, span[1] - a] : null;
  return (a > 0 ? "… " : "") + marked(text.slice(a, b), inner, kind) + (b < text.length ? " …" : "");
}

function foundBy(sides) {
  if (!Array.isArray(sides) || !sides.length) return "";
  const badges = sides.map((s) => `<span class="badge ${escapeHtml(s)}" title="${escapeHtml(SIDE_HELP[s] || s)}">${escapeHtml(SIDES[s] || s)}</span>`);
  return `<span class="found-by"><span class="muted">found by</span> ${badges.join(" ")}</span>`;
}

// `mark`: "answer" or "guess" (a withheld answer) for /ask's evidence, whose block `best` holds
// it; null for /search's passages.
function renderEvidence(items, best, mark) {
  $("evidence-heading").hidden = !items.length;
  $("evidence-heading").textContent = mark ? "Evidence the reader read" : "Passages found";
  const views = items.map((e, i) => {
    const span = mark && i === best ? utf16Span(e.text, e.span) : null;
    return { whole: marked(e.text, span, mark), short: excerpt(e.text, span, mark) };
  });
  $("evidence").innerHTML = items.map((e, i) => {
    const scores = mark
      ? `retrieval ${e.retrieval_score.toFixed(3)} · p(block) ${(e.retrieval_prob ?? 0).toFixed(3)} · p(span) ${(e.span_prob ?? 0).toFixed(3)}`
      : `score ${e.score.toFixed(3)}`;
    const tag = mark && i === best ? `<span class="tag tag-${mark}">${mark === "guess" ? "best guess" : "answer"}</span>` : "";
    const hidden = i >= BLOCKS_SHOWN && i !== best ? " hidden" : "";
    return `<li class="${i === best ? "best" : ""}"${hidden}>` +
      `<div class="ev-head"><span class="title">${escapeHtml(e.title || e.id)}</span> ${tag} ${foundBy(e.found_by)}</div>` +
      `<p class="text" id="ev-text-${i}">${views[i].short ?? views[i].whole}</p>` +
      (views[i].short ? `<button type="button" class="expand link" data-i="${i}" aria-expanded="false" aria-controls="ev-text-${i}">Show whole text</button>` : "") +
      `<div class="scores">${escapeHtml(e.id)} · ${scores}</div></li>`;
  }).join("");
  const more = items.length - $("evidence").querySelectorAll("li:not([hidden])").length;
  $("more-evidence").hidden = more === 0;
  $("more-evidence").textContent = `Show ${more} more ${more === 1 ? "block" : "blocks"}`;
  $("evidence").querySelectorAll("button.expand").forEach((button) => {
    const view = views[Number(button.dataset.i)];
    button.addEventListener("click", () => {
      const open = button.getAttribute("aria-expanded") !== "true";
      $(button.getAttribute("aria-controls")).innerHTML = open ? view.whole : view.short;
      button.setAttribute("aria-expanded", String(open));
      button.textContent = open ? "Show less" : "Show whole text";
    });
  });
}

// ---- asking ----------------------------------------------------------------------------------

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question) return;
  const side = $("side").value || undefined;
  $("ask-button").disabled = true;
  $("ask-button").textContent = "Asking…";
  showError("");
  try {
    if (window.readerLoaded) {
      const r = await api("/ask", { question, side });  // the server's default k, which the confidence is calibrated for
      renderAnswer(r);
      renderEvidence(r.evidence, r.best ?? 0, r.no_answer ? "guess" : "answer");
      if (r.index_version) noteVersion(r.index_version);
    } else {
      const hits = await api("/search", { query: question, k: 5, side });
      $("answer").hidden = true;
      renderEvidence(hits, -1, null);
    }
  } catch (e) {
    $("answer").hidden = true;  // no earlier answer left standing under a failed question
    renderEvidence([], -1, null);
    showError(e.message);
  } finally {
    $("ask-button").disabled = false;
    $("ask-button").textContent = "Ask";
  }
}

// ---- documents -------------------------------------------------------------------------------

let knownId = null;  // the id whose existence the page last checked and showed: {id, exists}

// The ids a delete of `id` deletes: its document, and a file's every section and page ([]: none).
async function named(id) {
  try {
    return (await api(`/documents/${encodeURIComponent(id)}`, null, "GET")).documents ?? [id];
  } catch (e) {
    if (e.status === 404) return [];
    throw e;
  }
}

// Whether a document of this very id exists (a save replaces it).
async function exists(id) {
  return (await named(id)).includes(id);
}

function forgetId() {
  knownId = null;
  $("doc-exists").hidden = true;
  $("doc-button").textContent = "Add document";
}

// Says, next to the id, whether saving adds or replaces; returns whether the id exists.
async function checkId() {
  const id = $("doc-id").value.trim();
  if (!id) {
    forgetId();
    return false;
  }
  const found = await exists(id);
  if ($("doc-id").value.trim() !== id) return found;  // typed on meanwhile; a later check shows that
  knownId = { id, exists: found };
  $("doc-exists").hidden = !found;
  $("doc-exists").textContent = found ? `A document with the id “${id}” already exists: saving replaces it.` : "";
  $("doc-button").textContent = found ? "Replace document" : "Add document";
  return found;
}

function afterWrite(verb, id, r, where = "doc-status") {
  const many = r.count > 1 ? `: ${r.count} documents, every section of the file` : "";
  $(where).textContent = `${verb} “${id}”${many}. Index ${r.index_version} now has ${r.blocks} blocks.`;
  refreshStats();
  loadFiles();
}

async function saveDocument(event) {
  event.preventDefault();
  const doc = { id: $("doc-id").value.trim(), title: $("doc-title").value.trim(), text: $("doc-text").value.trim() };
  $("doc-button").disabled = true;
  try {
    const shown = knownId && knownId.id === doc.id ? knownId.exists : null;
    const found = await exists(doc.id);  // checked again before writing: someone may have added it meanwhile
    if (found && shown !== true) {  // never replace without having said so first
      await checkId();
      $("doc-status").textContent = `“${doc.id}” already exists. Press “Replace document” to replace it.`;
      $("doc-button").focus();
      return;
    }
    const r = await api("/documents", { documents: [doc] }, "POST", $("api-key").value);
    afterWrite(found ? "Replaced" : "Added", doc.id, r);
    await checkId();
  } catch (e) {
    $("doc-status").textContent = `Not saved: ${e.message}`;
  } finally {
    $("doc-button").disabled = false;
  }
}

async function askDelete() {
  const id = $("doc-id").value.trim();
  if (!id) {
    $("doc-status").textContent = "Type the id of the document to delete.";
    $("doc-id").focus();
    return;
  }
  let docs;
  try {
    docs = await named(id);
    if (!docs.length) {
      $("doc-status").textContent = `There is no document with the id “${id}”.`;
      return;
    }
  } catch (e) {
    $("doc-status").textContent = `Not deleted: ${e.message}`;
    return;
  }
  $("delete-question").textContent = deleteQuestion(id, docs.length, docs.length > 1 || docs[0] !== id);
  $("delete-confirm").dataset.id = id;
  $("delete-confirm").hidden = false;
  $("delete-yes").focus();
}

// What both deletes ask first, by id and from the file list: a name that is a file of several
// documents (sections, pages) says that every one of them goes.
function deleteQuestion(name, documents, wholeFile = documents > 1) {
  return `Delete “${name}”${wholeFile ? `, every section of the file (${documents} documents),` : ""} for good?`;
}

function closeDelete() {
  $("delete-confirm").hidden = true;
  $("delete-button").focus();
}

async function deleteDocument() {
  const id = $("delete-confirm").dataset.id;
  $("delete-yes").disabled = true;
  try {
    const r = await api(`/documents/${encodeURIComponent(id)}`, null, "DELETE", $("api-key").value);
    afterWrite("Deleted", id, r);
    await checkId();
  } catch (e) {
    $("doc-status").textContent = `Not deleted: ${e.message}`;
  } finally {
    $("delete-yes").disabled = false;
    closeDelete();
  }
}

// ---- the index's files: listed a page at a time, uploaded, deleted ---------------------------

let filesOffset = 0;
let filesAsked = 0;  // listings requested: only the latest one's answer is shown
let filesStale = false;  // a background listing skipped while the user was in the list: done on leaving it

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

// `background`: the index changed elsewhere (the status line saw it); not while the user is in
// the list (a confirmation open, a button focused), which a new list would take away.
async function loadFiles(background = false) {
  const busy = () => background && $("files").contains(document.activeElement);
  if (busy()) { filesStale = true; return; }
  filesStale = false;
  const asked = ++filesAsked;
  let r;
  try {
    r = await api(`/documents?offset=${filesOffset}&limit=${FILES_PER_PAGE}`, null, "GET");
  } catch (e) {
    if (asked === filesAsked) $("files-range").textContent = `Not listed: ${e.message}`;
    return;
  }
  if (asked !== filesAsked) return;
  if (busy()) { filesStale = true; return; }
  if (!r.files.length && filesOffset > 0) {  // the last page emptied (a delete): show the one before
    filesOffset = Math.max(0, filesOffset - FILES_PER_PAGE);
    return loadFiles();
  }
  $("files-range").textContent = r.total
    ? `${r.offset + 1}–${r.offset + r.files.length} of ${plural(r.total, "file")}, the last changed first`
    : "The index holds no documents.";
  $("files").innerHTML = r.files.map((f, i) => {
    const parts = f.documents > 1 ? ` · ${f.documents} sections` : "";
    return `<li><div class="file-head"><div class="file-what"><span class="title">${escapeHtml(f.title || f.name)}</span>` +
      `<span class="muted file-name">${escapeHtml(f.name)}${parts}</span></div>` +
      `<button type="button" class="secondary delete-file" data-i="${i}" aria-label="Delete ${escapeHtml(f.name)}">Delete</button></div>` +
      `<div class="confirm" hidden><p></p><button type="button" class="danger file-yes">Yes, delete it</button>` +
      `<button type="button" class="secondary file-no">Cancel</button></div></li>`;
  }).join("");
  $("files").querySelectorAll("li").forEach((li, i) => {
    const f = r.files[i];
    const confirm = li.querySelector(".confirm");
    const ask = li.querySelector(".delete-file");
    const close = () => { confirm.hidden = true; ask.focus(); };
    ask.addEventListener("click", () => {
      confirm.querySelector("p").textContent = deleteQuestion(f.name, f.documents);
      confirm.hidden = false;
      confirm.querySelector(".file-yes").focus();
    });
    confirm.querySelector(".file-no").addEventListener("click", close);
    confirm.addEventListener("keydown", (e) => { if (e.key === "Escape") close(); });
    confirm.querySelector(".file-yes").addEventListener("click", async (e) => {
      e.target.disabled = true;
      try {
        afterWrite("Deleted", f.name, await api(`/documents/${encodeURIComponent(f.name)}`, null, "DELETE", $("api-key").value), "files-status");
        $("files-heading").tabIndex = -1;  // its row goes: keyboard users go on from the list's heading
        $("files-heading").focus();
      } catch (err) {
        $("files-status").textContent = `Not deleted: ${err.message}`;
        e.target.disabled = false;
        close();
      }
    });
  });
  $("files-prev").disabled = r.offset === 0;
  $("files-next").disabled = r.offset + r.files.length >= r.total;
}

function turnPage(step) {
  filesOffset = Math.max(0, filesOffset + step * FILES_PER_PAGE);
  loadFiles();
}

let fileShown = null;  // the file name whose presence in the index the page last said

// Says, under the file input, whether uploading replaces a file of that name; returns whether one exists.
async function checkFile() {
  const file = $("file-input").files[0];
  const found = file ? (await named(file.name)).length > 0 : false;
  fileShown = file ? file.name : null;
  $("file-exists").hidden = !found;
  $("file-exists").textContent = found ? `The index holds a file named “${file.name}”: uploading replaces it.` : "";
  $("upload-button").textContent = found ? "Replace file" : "Upload file";
  return found;
}

async function uploadFile(event) {
  event.preventDefault();
  const file = $("file-input").files[0];
  if (!file) return;
  $("upload-button").disabled = true;
  try {
    const shown = fileShown === file.name && !$("file-exists").hidden;
    const found = (await named(file.name)).length > 0;  // checked again: someone may have added it meanwhile
    if (found && !shown) {  // never replace without having said so first
      await checkFile();
      $("files-status").textContent = `“${file.name}” is in the index already. Press “Replace file” to replace it.`;
      return;
    }
    const r = await api(`/documents/file?name=${encodeURIComponent(file.name)}`, file, "POST", $("api-key").value);
    const gone = r.deleted.length ? `, ${plural(r.deleted.length, "section")} it no longer has deleted` : "";
    $("files-status").textContent = `${found ? "Replaced" : "Uploaded"} “${file.name}”: ${plural(r.added.length, "document")}${gone}. ` +
      `Index ${r.index_version} now has ${r.blocks} blocks.`;
    $("file-input").value = "";
    await checkFile();
    filesOffset = 0;  // the last changed file is listed first
    refreshStats();
    loadFiles();
  } catch (e) {
    $("files-status").textContent = `Not uploaded: ${e.message}`;
  } finally {
    $("upload-button").disabled = false;
  }
}

// ---- the status line -------------------------------------------------------------------------

let version = null;  // the index version the page last saw
let swappedAt = "";

function noteVersion(v) {
  if (version !== null && v !== version) swappedAt = ` · swapped to ${v} at ${new Date().toLocaleTimeString()}`;
  version = v;
}

let statsAsked = 0;  // as filesAsked: an answer overtaken by a later request is dropped

async function refreshStats() {
  const asked = ++statsAsked;
  try {
    const s = await api("/stats", null, "GET");
    if (asked !== statsAsked) return;
    noteVersion(s.index_version);
    window.readerLoaded = s.reader_loaded;
    const live = s.overlay_documents ? ` · ${s.overlay_documents} added live` : "";
    const text = `index ${s.index_version} · ${s.corpus_blocks} blocks${live}` +
      (s.reader_loaded ? "" : " · no reader: showing passages") + swappedAt;
    if ($("status").textContent !== text) {  // a live region: speak changes only
      if ($("status").textContent.includes("blocks")) loadFiles(true);  // the index changed (another client, a swap)
      $("status").textContent = text;
    }
    const select = $("side");
    if (select.options.length !== s.kinds.length) {
      select.innerHTML = s.kinds.map((r) => `<option value="${r}">${escapeHtml(KIND_LABELS[r] || r)}</option>`).join("");
    }
  } catch (e) {
    if (asked === statsAsked) $("status").textContent = "server unreachable, retrying…";
  }
}

async function pollStats() {
  await refreshStats();
  setTimeout(pollStats, STATS_POLL_MS);
}

function showAllEvidence() {
  const first = $("evidence").querySelector("li[hidden]");
  $("evidence").querySelectorAll("li[hidden]").forEach((li) => { li.hidden = false; });
  $("more-evidence").hidden = true;
  const title = first?.querySelector(".title");
  if (title) {  // keyboard and screen-reader users go on reading where the list grew
    title.tabIndex = -1;
    title.focus();
  }
}

let idTimer = null;
$("ask-form").addEventListener("submit", ask);
$("doc-form").addEventListener("submit", saveDocument);
$("doc-id").addEventListener("input", () => {
  forgetId();  // until the new id is checked, saving checks it first
  clearTimeout(idTimer);
  idTimer = setTimeout(() => checkId().catch(() => {}), 300);
});
$("more-evidence").addEventListener("click", showAllEvidence);
$("delete-button").addEventListener("click", askDelete);
$("delete-yes").addEventListener("click", deleteDocument);
$("delete-no").addEventListener("click", closeDelete);
$("delete-confirm").addEventListener("keydown", (e) => { if (e.key === "Escape") closeDelete(); });
$("upload-form").addEventListener("submit", uploadFile);
$("file-input").addEventListener("change", () => checkFile().catch(() => {}));
$("files").addEventListener("focusout", (e) => { if (filesStale && !$("files").contains(e.relatedTarget)) loadFiles(true); });
$("files-prev").addEventListener("click", () => turnPage(-1));
$("files-next").addEventListener("click", () => turnPage(1));
pollStats();
loadFiles();
