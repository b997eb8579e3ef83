// The console's few lines of script; every page works without them (the server checks all).
// A receipt field (data-json) says at once when what was typed is not valid JSON.
// The queue's heading box (data-select-all="FORM") ticks every row box of FORM on the page,
// and data-selected-count="FORM" says how many are ticked.
// A bulk action's confirmation shows its progress note while the request runs (htmx adds
// htmx-request to a boosted form; "busy" does it for a plain submission).
(function () {
  "use strict";
  function checkJson(field) {
    var text = field.value.trim();
    if (!text) { field.setCustomValidity(""); return; }
    try { JSON.parse(text); field.setCustomValidity(""); }
    catch (e) { field.setCustomValidity("The receipt must be valid JSON."); }
  }
  function rowBoxes(formId) {
    return document.querySelectorAll('input[type=checkbox][name=id][form="' + formId + '"]');
  }
  function refresh(formId) {
    var boxes = rowBoxes(formId), ticked = 0, i;
    for (i = 0; i < boxes.length; i++) { if (boxes[i].checked) { ticked++; } }
    var all = document.querySelector('input[data-select-all="' + formId + '"]');
    if (all) {
      all.checked = boxes.length > 0 && ticked === boxes.length;
      all.indeterminate = ticked > 0 && ticked < boxes.length;
    }
    var count = document.querySelector('[data-selected-count="' + formId + '"]');
    if (count) { count.textContent = ticked + " selected"; }
  }
  document.addEventListener("input", function (event) {
    if (event.target.matches && event.target.matches("textarea[data-json]")) {
      checkJson(event.target);
    }
  });
  document.addEventListener("change", function (event) {
    var box = event.target, formId, boxes, i;
    if (!box.matches) { return; }
    if (box.matches("input[data-select-all]")) {
      formId = box.getAttribute("data-select-all");
      boxes = rowBoxes(formId);
      for (i = 0; i < boxes.length; i++) { boxes[i].checked = box.checked; }
      refresh(formId);
    } else if (box.matches("input[type=checkbox][name=id][form]")) {
      refresh(box.getAttribute("form"));
    }
  });
  document.addEventListener("submit", function (event) {
    if (event.target.querySelector && event.target.querySelector(".progress-note")) {
      event.target.classList.add("busy");
    }
  });
})();
