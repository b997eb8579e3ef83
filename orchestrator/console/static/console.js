// The console's few lines of script; every page works without them (the server checks all).
// A receipt field (data-json) says at once when what was typed is not valid JSON.
(function () {
  "use strict";
  function checkJson(field) {
    var text = field.value.trim();
    if (!text) { field.setCustomValidity(""); return; }
    try { JSON.parse(text); field.setCustomValidity(""); }
    catch (e) { field.setCustomValidity("The receipt must be valid JSON."); }
  }
  document.addEventListener("input", function (event) {
    if (event.target.matches && event.target.matches("textarea[data-json]")) {
      checkJson(event.target);
    }
  });
})();
